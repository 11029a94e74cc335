"""Issue 26, defect 8: the documented replay and rl_precision commands work on a fresh clone, where no trace is
committed (``results/*/*/_state/`` is ignored): each sits in a block after the `pf-bench rl` command that
writes its trace, and a missing trace says which command writes it."""

from __future__ import annotations

import re
import shlex

import pytest
from support import REPO
from typer.testing import CliRunner

from harness.cli import app
from harness.rl.precision import main as precision_main
from harness.spec.safe_yaml import load as load_yaml_text

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)
INLINE = re.compile(r"`([^`]+)`")
TRACE = re.compile(r"(\S+)/_state/traces/\S+")


def _writes(line: str) -> str | None:
    """``OUT/<spec name>/<preset>`` for a `pf-bench rl SPEC [--preset P] --out OUT` line, else None."""
    if "pf-bench rl " not in line:
        return None
    words = shlex.split(line.split("pf-bench rl ", 1)[1].split("&&")[0].split("#")[0])
    spec, opts = words[0], dict(zip(words[1::2], words[2::2], strict=False))
    name = load_yaml_text((REPO / spec).read_text())["name"]
    return f"{opts['--out']}/{name}/{opts.get('--preset', 'default')}"


def test_every_documented_trace_command_follows_the_command_that_writes_it():
    problems = []
    for doc in DOCS:
        text = doc.read_text()
        blocks = FENCE.findall(text)
        prose = FENCE.sub("", text)
        for span in INLINE.findall(prose):  # a command in running text has no block to write its trace in
            if ("pf-bench replay" in span or "rl_precision" in span) and TRACE.search(span):
                problems.append(f"{doc.name}: `{' '.join(span.split())}` outside a command block")
        for block in blocks:
            written: set[str] = set()
            for line in block.splitlines():
                if (w := _writes(line)) is not None:
                    written.add(w)
                for m in TRACE.finditer(line):
                    if m.group(1).lstrip("`") not in written:
                        problems.append(
                            f"{doc.name}: {line.strip()} runs before any command writes its trace"
                        )
    assert not problems, "\n".join(problems)


MISSING = "results/claim2/cpu/_state/traces/baseline-fp32-s0"
HINT = "`pf-bench rl experiments/claim2.yaml --preset cpu --out results` writes it"


def test_replay_of_an_uncommitted_trace_says_which_command_writes_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["replay", MISSING, "--out", str(tmp_path / "r")])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert HINT in " ".join(res.output.split()), res.output


def test_rl_precision_of_an_uncommitted_trace_says_which_command_writes_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        precision_main([MISSING])
    assert e.value.code == 2 and HINT in capsys.readouterr().err
