"""Issue 26, defects 2 and 5: `pf-bench rl` specs that passed validation and died mid-run (or trained nothing)
are refused before any work, in one line naming the field; a spec whose runs cannot fit in memory is refused
from its meta-device build."""

from __future__ import annotations

import copy

import pytest
import yaml
from support import REPO
from support.rl_tiny import TINY_SPEC
from typer.testing import CliRunner

from harness.cli import app
from harness.rl.memory import check_rl_spec
from harness.rl.run import plans_of
from harness.rl.spec import RL_PRESETS, load_rl_spec
from prefixflow.memory import limit as ml

runner = CliRunner()
CLAIM2 = REPO / "experiments" / "claim2.yaml"


def refused(tmp_path, changes: dict, *needles: str, env=None) -> str:
    raw = copy.deepcopy(TINY_SPEC)
    for key, value in changes.items():
        where = raw
        *path, last = key.split(".")
        for p in path:
            where = where[p]
        where[last] = value
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    res = runner.invoke(app, ["rl", str(spec), "--out", str(out)], env=env, catch_exceptions=False)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and res.output.startswith("error:"), res.output
    text = " ".join(res.output.split())
    for n in needles:
        assert n in text, text
    assert not out.exists(), "work started before the refusal"
    return text


@pytest.mark.parametrize(
    ("changes", "needles"),
    [
        ({"loop.kl_coef": float("inf")}, ("loop.kl_coef",)),
        ({"loop.eps": float("inf")}, ("loop.eps",)),
        ({"loop.eps": 10.0}, ("loop.eps", "less than or equal to 1")),
        ({"loop.weight_decay": 1e300}, ("loop.weight_decay",)),
        ({"loop.weight_decay": 5.0, "loop.lr": 0.5}, ("lr * weight_decay = 2.5 >= 1",)),
        ({"loop.lr_warmup_steps": 10**18}, ("lr_warmup_steps (1000000000000000000) exceeds steps (3)",)),
        ({"loop.clip_eps_high": float("inf")}, ("loop.clip_eps_high",)),
        ({"loop.max_grad_norm": float("inf")}, ("loop.max_grad_norm",)),
        ({"model": {"name": "hf:llama-tiny"}}, ("model", "TorchTitan models only")),
    ],
)
def test_schema_refuses_values_that_die_mid_run_or_train_nothing(tmp_path, changes, needles):
    refused(tmp_path, changes, *needles)


def test_max_new_tokens_beyond_the_models_positions_is_refused(tmp_path):
    """The prompt is 27 tokens; max_seq_len 29 leaves 2 for the responses, and max_new_tokens is 4."""
    refused(
        tmp_path,
        {"model.overrides.max_seq_len": 29},
        "is 31 tokens, more than the model's max_seq_len=29",
        "lower loop.max_new_tokens to 2",
    )


def test_max_seq_len_below_the_prompt_is_refused(tmp_path):
    """`max_seq_len: 16` on claim2's 93-token prompts was a 194-line RoPE AssertionError."""
    raw = yaml.safe_load(CLAIM2.read_text())
    raw["model"]["overrides"]["max_seq_len"] = 16
    spec = tmp_path / "claim2.yaml"
    spec.write_text(yaml.safe_dump(raw))
    res = runner.invoke(app, ["rl", str(spec), "--preset", "smoke", "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    text = " ".join(res.output.split())
    assert "max_seq_len=16: the task's prompt alone is 93 tokens" in text, text


def test_runs_that_cannot_fit_are_refused_from_the_meta_build(tmp_path):
    """An rl spec with `dim: 65536` allocated and became an oom; now refused before any work."""
    text = refused(
        tmp_path,
        {"model.overrides.dim": 65536, "model.overrides.n_heads": 4},
        "needs at least",
        "schedule: sequential",
        env={ml.ENV: "4G"},
    )
    assert "the configured budget" in text


@pytest.mark.parametrize("preset", [None, *(p for p in RL_PRESETS if p != "paper")])
def test_committed_rl_presets_fit_a_small_machine(preset):
    """claim2.yaml at its default scale and every CPU preset pass the memory check under 4 GiB."""
    import torch

    spec = load_rl_spec(CLAIM2, preset)
    runs = len(plans_of(spec)) if spec.schedule == "lockstep" else 1
    check_rl_spec(spec, runs, torch.device("cpu"), budget=4 * 2**30)


@pytest.mark.parametrize(
    "exc", [ValueError("loop.n: bad value"), TypeError("bad type"), OSError(28, "No space")]
)
def test_rl_cli_turns_any_user_error_into_one_line(tmp_path, monkeypatch, exc):
    """The rl command caught RuntimeError (and its own errors) only: a ValueError from deep in the loop was a
    traceback."""
    import harness.rl.run as rl_run

    def fails(*a, **k):
        raise exc

    monkeypatch.setattr(rl_run, "run_claim2", fails)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(TINY_SPEC))
    res = runner.invoke(app, ["rl", str(spec), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and res.output.startswith("error:"), res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1, res.output
