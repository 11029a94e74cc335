"""`pf-bench rl` on many ranks: the closed loop with a TP2 x CP2 actor on 4 local ranks against one process.

One launch (4 ranks, through the CLI as a user runs it) and one rerun of it (every run resumes on every
rank, nothing is redone). The same spec without a parallel layout runs in this process. Rollouts are
sampled on other ranks than in one process (prompt i on rank i mod 4) with the same per-prompt noise, so
every reward must be equal; losses, drifts and checkpointed weights equal to fp32 rounding.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from support import REPO
from support.rl_tiny import RANKS_SPEC
from typer.testing import CliRunner

from harness.cli import app
from harness.records import read_records
from harness.rl.io import load_tensors
from harness.rl.run import RLRunError, run_claim2
from harness.rl.spec import parse_rl_spec

SPEC = {
    **RANKS_SPEC,
    "name": "ranks",
    "loop": {**RANKS_SPEC["loop"], "kl_coef": 1e-3},
    "seed": 0,
    "reference_seed": 1,
    "checkpoint_every": 3,
    "trace": {"steps": 2, "runs": [{"dtype": "fp32"}], "systems": ["prefixflow"]},
    "claim3_reference": {"warmup": 0, "repeats": 1},
    "parallel": {"tp": 2, "cp": 2},
}
RUNS = ["baseline-s0", "baseline-s1", "prefixflow-s0", "prefixflow-s1"]
runner = CliRunner()


def _launch(spec: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harness.cli", "rl", str(spec), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "PF_BENCH_THREADS": "1"},
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rl_ranks")
    spec = tmp / "ranks.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    first = _launch(spec, tmp / "multi")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    folder = tmp / "multi" / "ranks" / "default"
    before = {p.name: read_records(p) for p in (folder / "records").glob("*.parquet")}
    again = _launch(spec, tmp / "multi")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    vocab = json.loads(before["baseline-s0.parquet"]["model_overrides"].iloc[0])["vocab_size"]
    single = {**SPEC, "parallel": {}}
    single["model"] = {**SPEC["model"], "overrides": {**SPEC["model"]["overrides"], "vocab_size": vocab}}
    one = run_claim2(parse_rl_spec(single), None, tmp / "one", log=lambda m: None)
    return {"multi": folder, "one": one, "before": before, "rerun": again.stdout, "log": first.stdout}


def test_the_loop_on_four_ranks_matches_one_process(runs):
    for run in RUNS:
        multi = read_records(runs["multi"] / "records" / f"{run}.parquet").sort_values("step")
        one = read_records(runs["one"] / "records" / f"{run}.parquet").sort_values("step")
        assert list(multi["step"]) == list(one["step"]) and len(multi) >= 2
        assert list(multi["reward_mean"]) == list(one["reward_mean"]), run  # the same rollouts
        assert list(multi["response_tokens"]) == list(one["response_tokens"]), run
        assert torch.allclose(torch.tensor(list(multi["loss"])), torch.tensor(list(one["loss"])), atol=1e-6)
        assert torch.allclose(
            torch.tensor(list(multi["drift_rms"])), torch.tensor(list(one["drift_rms"])), rtol=1e-3
        )
        assert multi["drift_rms"].iloc[-1] > 1e-4  # the weights moved
    # fp32 rounding (the warm start's already differs), amplified by AdamW's sign-like steps on near-zero
    # gradients: far below the weights' own drift from the warm start, which a wrong update would match
    warm = load_tensors(runs["one"] / "_state" / "warmstart.safetensors")[0]
    for run in RUNS:
        path = Path("_state") / "runs" / run / "checkpoints" / "step_00003.safetensors"
        a, b = load_tensors(runs["multi"] / path)[0], load_tensors(runs["one"] / path)[0]
        assert sorted(a) == sorted(b)
        n = sum(v.numel() for v in a.values())
        rmse = (sum(float((a[k] - b[k]).double().pow(2).sum()) for k in a) / n) ** 0.5
        drift = (sum(float((b[k] - warm[f"w.{k}"]).double().pow(2).sum()) for k in b) / n) ** 0.5
        assert rmse < 2e-3 * drift and max(float((a[k] - b[k]).abs().max()) for k in a) < 2e-4, run


def test_rank_zero_writes_records_of_the_parallel_actor_with_slowest_rank_times(runs):
    rows = read_records(runs["multi"] / "records" / "prefixflow-s0.parquet")
    assert set(rows["actor_layout"]) == {"cp2-tp2"} and set(rows["world_size"]) == {4}
    phases = rows[[f"{p}_s" for p in ("generation", "reward", "evaluation", "update", "sync")]].sum(axis=1)
    assert ((rows["step_s"] - phases).abs() < 1e-9).all() and (rows["update_s"] > 0).all()
    single = read_records(runs["one"] / "records" / "prefixflow-s0.parquet")
    assert set(single["actor_layout"]) == {"single"}
    ref = read_records(runs["multi"] / "claim3-reference.parquet")  # train_group alone, on the same 4 ranks
    assert set(ref["system"]) == {"baseline", "prefixflow_split"} and set(ref["world_size"]) == {4}
    assert all(len(json.loads(v)) == 4 for v in ref["step_time_s_per_rank"])
    div = read_records(runs["multi"] / "divergence.parquet")
    assert len(div) == 6 and (div["step"] == 3).all()
    replay = read_records(runs["multi"] / "replay-baseline-fp32-s0-prefixflow.parquet")
    assert list(replay["step"]) == [1, 2] and replay["tau_pass"].all() and (replay["max_rel"] < 1e-5).all()
    assert runs["log"].count("warm start: reward") == 1  # one rank logs


def test_a_rerun_resumes_every_run_on_every_rank_and_redoes_nothing(runs):
    for run in RUNS:
        assert f"{run}: resumed at step" in runs["rerun"]
        after = read_records(runs["multi"] / "records" / f"{run}.parquet")
        assert list(after["timestamp"]) == list(runs["before"][f"{run}.parquet"]["timestamp"])


@pytest.mark.parametrize(
    "parallel, needle",
    [({"pp": 2}, "pp=2"), ({"dp_shard": 2, "ep": 2}, "ep=2"), ({"tp": 3}, "multiple of parallel.tp=3")],
)
def test_layouts_the_loop_cannot_run_are_refused_before_any_work(tmp_path, parallel, needle):
    spec = tmp_path / "s.yaml"
    raw = {**SPEC, "parallel": parallel}
    if "tp" in parallel:
        raw["model"] = {**SPEC["model"], "overrides": {**SPEC["model"]["overrides"], "vocab_size": 64}}
    spec.write_text(yaml.safe_dump(raw))
    res = runner.invoke(app, ["rl", str(spec), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and needle in res.output and "Traceback" not in res.output, res.output
    assert not (tmp_path / "out").exists()


def test_a_multi_rank_spec_in_one_process_is_refused(tmp_path):
    with pytest.raises(RLRunError, match="start it with `pf-bench rl`"):
        run_claim2(parse_rl_spec(SPEC), None, tmp_path / "out")
    assert not (tmp_path / "out").exists()
