"""The command-line surface stays put: every ``pf-bench`` subcommand and each option's name, type and
default match ``tests/cli_surface.json`` (today's snapshot), and the documented entry points answer
``--help`` where users type them.

Adding a command or an option is allowed (rewrite the snapshot with ``python tests/harness/test_cli_surface.py``);
renaming or retyping one, or changing a default, is what this test is for.
"""

from __future__ import annotations

import enum
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from support import REPO

ROOT = REPO
SNAPSHOT = Path(__file__).with_name("cli_surface.json")


def _plain(value):
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _type_name(annotation) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "").replace("pathlib.", "")


def _param(p) -> dict:
    annotation = p.type_descriptor.annotation
    out = {
        "name": p.name,
        "kind": p.param_type_name,
        "opts": list(p.opts) + list(p.secondary_opts),
        "type": _type_name(annotation),
        "required": p.required,
        "multiple": p.multiple,
        "default": _plain(p.default),
        "is_flag": getattr(p, "is_flag", False),
    }
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        out["choices"] = [m.value for m in annotation]
    for bound in ("min", "max"):
        if getattr(p, bound, None) is not None:
            out[bound] = p.__dict__[bound]
    return out


def _command(cmd) -> dict:
    out: dict = {"params": [_param(p) for p in cmd.params]}
    if hasattr(cmd, "commands"):
        out["commands"] = {name: _command(sub) for name, sub in sorted(cmd.commands.items())}
    return out


def surface() -> dict:
    """The live ``pf-bench`` command tree: commands (nested), options, their types and defaults."""
    from harness.cli import app

    return _command(typer.main.get_command(app))


def test_pf_bench_commands_and_options_match_the_snapshot():
    live, saved = surface(), json.loads(SNAPSHOT.read_text())
    assert sorted(live["commands"]) == sorted(saved["commands"]), "pf-bench subcommands changed"
    for name, cmd in saved["commands"].items():
        live_params = {p["name"]: p for p in live["commands"][name]["params"]}
        for p in cmd["params"]:
            assert p["name"] in live_params, f"pf-bench {name}: option {p['opts']} is gone"
            assert live_params[p["name"]] == p, f"pf-bench {name} {p['opts']}: changed"
        assert live["commands"][name].get("commands") == cmd.get("commands"), f"pf-bench {name}: subcommands"


def test_the_snapshot_covers_every_command_and_sees_a_changed_default():
    saved = json.loads(SNAPSHOT.read_text())
    assert {"run", "sweep", "rl", "replay", "figures"} <= set(saved["commands"])
    live = surface()
    run = next(p for p in live["commands"]["run"]["params"] if p["name"] == "repeats")
    assert run["default"] == 3 and run["type"] == "int"
    live["commands"]["run"]["params"][0]["default"] = "changed"
    assert live != saved


ENTRY_POINTS = [
    [str(Path(sys.executable).with_name("pf-bench"))],
    [sys.executable, "-m", "harness.local_ranks"],
    [sys.executable, "-m", "harness.rl_precision"],
]


@pytest.mark.parametrize("command", ENTRY_POINTS, ids=["pf-bench", "local_ranks", "rl_precision"])
def test_documented_entry_points_answer_help(command):
    if not Path(command[0]).exists():
        pytest.skip(f"{command[0]} is not installed")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    res = subprocess.run([*command, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "usage" in (res.stdout + res.stderr).lower()


if __name__ == "__main__":
    SNAPSHOT.write_text(json.dumps(surface(), indent=1) + "\n")
    print(f"wrote {SNAPSHOT}")
