"""Frozen-trace export and replay: the baseline replays its own trace bitwise, PrefixFlow within fp32 noise,
a changed input is detected, and a corrupted, truncated or hostile trace is refused naming the file."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from support.rl_tiny import TINY_SPEC, tiny_spec
from typer.testing import CliRunner

from harness.cli import app
from harness.records import read_records
from harness.rl.io import TraceError, load_tensors, sha256_of
from harness.rl.precision import step_gradients
from harness.rl.run import run_claim2
from harness.rl.trace import load_trace, replay_trace


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> Path:
    """A baseline run of 3 steps that exports its trace (fp32) and replays it with both systems."""
    spec = tiny_spec(
        trainers=["baseline"],
        trace={"steps": 3, "runs": [{"dtype": "fp32"}], "systems": ["baseline", "prefixflow"]},
        loop={**TINY_SPEC["loop"], "kl_coef": 0.01},  # the trace then carries reference log-probs too
        # rewards vary within a group, so the traced steps have gradients, on any torch (with the 2-step warm
        # start they depended on the initialisation's draws, which torch 2.11 and 2.13 make differently)
        warm_start={**TINY_SPEC["warm_start"], "steps": 40, "batch": 8, "lr": 3e-3},
    )
    return run_claim2(spec, None, tmp_path_factory.mktemp("traced"), log=lambda _: None)


def trace_dir(folder: Path) -> Path:
    return folder / "_state" / "traces" / "baseline-fp32-s0"


def copy_trace(folder: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "trace"
    shutil.copytree(trace_dir(folder), dst)
    return dst


def test_baseline_replays_its_own_trace_bitwise(traced):
    rows = read_records(traced / "replay-baseline-fp32-s0-baseline.parquet")
    assert list(rows["step"]) == [1, 2, 3]
    assert (rows["max_abs"] == 0).all() and (rows["loss"] == rows["source_loss"]).all()


def test_prefixflow_replay_within_fp32_noise(traced):
    rows = read_records(traced / "replay-baseline-fp32-s0-prefixflow.parquet")
    assert (rows["max_rel"] < 1e-5).all() and rows["tau_pass"].all()
    assert (rows["max_abs"] > 0).any()  # a different schedule: not bitwise, only close


def test_fp64_replay_measures_the_fp32_source_rounding_and_prefixflow_gradients_match_it(traced):
    floor = read_records(traced / "replay-baseline-fp32-s0-baseline-fp64.parquet")
    assert (floor["replay_dtype"] == "fp64").all() and (floor["max_abs"] > 0).all()
    trace = load_trace(trace_dir(traced))
    truth = step_gradients(trace, 1, "baseline", torch.float64)
    exact = step_gradients(trace, 1, "prefixflow", torch.float64)
    fp32 = {s: step_gradients(trace, 1, s, torch.float32) for s in ("baseline", "prefixflow")}
    for name, g in truth.items():
        assert torch.allclose(exact[name], g, rtol=1e-10, atol=1e-14), name
        base_err = float((fp32["baseline"][name] - g).norm())
        # PrefixFlow's fp32 gradients are as close to fp64 as the baseline's own (rounding, no bias)
        assert float((fp32["prefixflow"][name] - g).norm()) <= 4 * base_err + 1e-9 * float(g.norm()), name


def test_trace_files_are_safetensors_and_json(traced):
    folder = trace_dir(traced)
    names = sorted(p.name for p in folder.iterdir())
    assert names[0] == "after_00001.safetensors" and "manifest.json" in names
    assert all(n.endswith((".safetensors", ".json")) for n in names)
    step, _ = load_tensors(folder / "step_00001.safetensors")
    assert {"g0.prompt", "g0.responses", "g0.advantages", "g0.old_logprobs", "g0.ref_logprobs"} <= set(step)


def _rewrite(folder: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Replace one file of a trace and update its hash in the manifest (a well-formed, different trace)."""
    save_file(tensors, str(folder / name))
    manifest = json.loads((folder / "manifest.json").read_text())
    for ref in [manifest["initial"]] + [r[k] for r in manifest["steps"] for k in ("inputs", "after")]:
        if ref["file"] == name:
            ref["sha256"] = sha256_of(folder / name)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_a_perturbed_advantage_breaks_the_round_trip(traced, tmp_path):
    folder = copy_trace(traced, tmp_path)
    tensors, _ = load_tensors(folder / "step_00002.safetensors")
    tensors["g1.advantages"][0] += 0.01  # (advantages can all be 0 in a tiny run: add, not scale)
    _rewrite(folder, "step_00002.safetensors", tensors)
    rows = replay_trace(load_trace(folder), "baseline")
    assert rows[0]["max_abs"] == 0 and rows[1]["max_abs"] > 0 and rows[2]["max_abs"] > 0


def _expect_refused(folder: Path, match: str) -> None:
    with pytest.raises(TraceError, match=match):
        replay_trace(load_trace(folder), "prefixflow")


def test_flipped_byte_is_refused_naming_the_file(traced, tmp_path):
    folder = copy_trace(traced, tmp_path)
    path = folder / "step_00002.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    _expect_refused(folder, r"step_00002\.safetensors: SHA-256 does not match")


def test_truncated_file_is_refused_even_with_a_matching_hash(traced, tmp_path):
    folder = copy_trace(traced, tmp_path)
    path = folder / "after_00001.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    _expect_refused(folder, r"after_00001\.safetensors: SHA-256")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["steps"][0]["after"]["sha256"] = sha256_of(
        path
    )  # a consistent manifest: the format check catches it
    (folder / "manifest.json").write_text(json.dumps(manifest))
    _expect_refused(folder, r"after_00001\.safetensors: not a valid safetensors file")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda m: m["steps"][0]["inputs"].update(file="../../etc/passwd.safetensors"), "not a plain"),
        (lambda m: m.update(format="pickle"), "invalid manifest at format"),
        (lambda m: m["steps"].pop(0), "numbered 1"),
        (lambda m: m.update(steps=m["steps"] + [m["steps"][0]]), "numbered 1"),
    ],
)
def test_hostile_manifest_is_refused(traced, tmp_path, edit, match):
    folder = copy_trace(traced, tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    edit(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TraceError, match=match):
        load_trace(folder)


def test_inconsistent_tensors_are_refused(traced, tmp_path):
    folder = copy_trace(traced, tmp_path)
    tensors, _ = load_tensors(folder / "step_00001.safetensors")
    tensors["g0.old_logprobs"] = tensors["g0.old_logprobs"][:-1].contiguous()
    _rewrite(folder, "step_00001.safetensors", tensors)
    _expect_refused(folder, r"step_00001\.safetensors: g0\.old_logprobs holds")
    tensors, _ = load_tensors(folder / "initial.safetensors")
    name = next(iter(tensors))
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    _rewrite(folder, "initial.safetensors", tensors)
    _expect_refused(folder, r"initial\.safetensors: .* NaN")


def test_replay_cli_writes_records_and_refuses_a_damaged_trace(traced, tmp_path):
    runner = CliRunner()
    folder = copy_trace(traced, tmp_path)
    out = tmp_path / "out"
    res = runner.invoke(app, ["replay", str(folder), "--system", "prefixflow", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert len(read_records(out / "replay-trace-prefixflow.parquet")) == 3
    (folder / "manifest.json").write_text("{not json")
    res = runner.invoke(app, ["replay", str(folder), "--out", str(out)])
    assert res.exit_code == 2 and "manifest.json: unreadable JSON" in res.output
    assert "Traceback" not in res.output


def test_manifest_naming_another_model_is_refused_before_building_it(traced, tmp_path):
    folder = copy_trace(traced, tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["model"], manifest["overrides"] = "llama3:8B", {}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    _expect_refused(folder, r"initial\.safetensors: its weights do not match the model llama3:8B")


def _with_adam_state(folder: Path, **bad) -> str:
    """Give ``initial.safetensors`` AdamW state for every parameter (finite), one tensor replaced by ``bad``;
    returns the parameter whose state is bad."""
    tensors, _ = load_tensors(folder / "initial.safetensors")
    names = [k.removeprefix("w.") for k in tensors if k.startswith("w.")]
    for name in names:
        w = tensors[f"w.{name}"]
        tensors[f"opt.exp_avg.{name}"] = torch.zeros_like(w)
        tensors[f"opt.exp_avg_sq.{name}"] = torch.zeros_like(w)
        tensors[f"opt.step.{name}"] = torch.tensor(1.0)
    key, value = next(iter(bad.items()))
    tensors[f"opt.{key}.{names[0]}"] = value(tensors[f"w.{names[0]}"])
    _rewrite(folder, "initial.safetensors", tensors)
    return names[0]


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("step", lambda w: torch.tensor(-1.0), r"is -1: an AdamW step count is a whole number >= 0"),
        ("step", lambda w: torch.tensor(1.5), r"is 1\.5: an AdamW step count"),
        (
            "exp_avg_sq",
            lambda w: torch.full_like(w, -1.0),
            r"has negative values \(min -1\): AdamW's second moment is >= 0",
        ),
    ],
)
def test_finite_but_impossible_adamw_state_is_refused_naming_it(traced, tmp_path, key, value, match):
    """A negative step or second moment is finite, and its first step would turn every weight NaN."""
    folder = copy_trace(traced, tmp_path)
    name = _with_adam_state(folder, **{key: value})
    _expect_refused(folder, rf"initial\.safetensors: opt\.{key}\.{re.escape(name)} {match}")
    res = CliRunner().invoke(app, ["replay", str(folder), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and f"opt.{key}.{name}" in res.output and "Traceback" not in res.output


def test_a_nan_weight_makes_every_metric_nan_and_fails_the_tau_rule(tmp_path):
    """Python's max() drops NaN (max(0.0, nan) == 0.0): a replay whose weights turn NaN must not read as equal."""
    from harness.rl.trace import _compare

    y = {"w.a": torch.ones(3), "w.b": torch.ones(2)}
    for spoiled in ({"a": torch.tensor([1.0, float("nan"), 1.0]), "b": torch.ones(2)},
                    {"a": torch.ones(3), "b": torch.tensor([float("nan"), 1.0])}):  # fmt: skip
        got = _compare(spoiled, y, tmp_path)
        assert got["tau_pass"] is False
        for key in ("max_abs", "max_rel", "tau_worst", "rmse", "mean_abs"):
            assert math.isnan(got[key]), (key, got)
        got = _compare(spoiled, {"w.a": spoiled["a"].clone(), "w.b": spoiled["b"].clone()}, tmp_path)
        assert got["tau_pass"] is False and math.isnan(got["max_abs"])  # NaN on both sides is no match either
    same = _compare({"a": torch.ones(3), "b": torch.ones(2)}, y, tmp_path)
    assert same["tau_pass"] and same["max_abs"] == same["tau_worst"] == 0.0


def test_rl_precision_on_a_missing_trace_says_why_in_one_line(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "harness.rl_precision", str(tmp_path / "missing")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "missing: not a trace folder" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
