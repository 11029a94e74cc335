"""`pf-bench rl --executor slurm`: a data-parallel (FSDP2, dp_shard=2) closed loop as one two-task job of the
local Slurm (one task per rank), against the same spec in one process."""

from __future__ import annotations

import yaml
from support.rl_tiny import RANKS_SPEC
from support.slurm_marks import SLURM_JOB_MARKS
from typer.testing import CliRunner

from harness.cli import app
from harness.records import read_records
from harness.rl.run import run_claim2
from harness.rl.spec import parse_rl_spec
from harness.safe_fs import jobs_folder

pytestmark = SLURM_JOB_MARKS

SPEC = {
    **RANKS_SPEC,
    "name": "rlslurm",
    "loop": {**RANKS_SPEC["loop"], "steps": 2},
    "reference_seed": None,
    "checkpoint_every": 2,
    "trace": None,
    "claim3_reference": {"enabled": False},
    "schedule": "sequential",
    "parallel": {"dp_shard": 2},
    "executor": {"timeout_min": 10, "overcommit": True, "mem_gb": 4},
}


def test_the_loop_runs_as_one_slurm_job_of_one_task_per_rank(tmp_path):
    spec = tmp_path / "rl.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["rl", str(spec), "--out", str(out), "--executor", "slurm"])
    assert res.exit_code == 0, res.output
    folder = out / "rlslurm" / "default"
    one = run_claim2(parse_rl_spec({**SPEC, "parallel": {}}), None, tmp_path / "one", log=lambda _: None)
    for run in ("baseline-s0", "prefixflow-s0"):
        rows = read_records(folder / "records" / f"{run}.parquet")
        assert list(rows["step"]) == [1, 2] and set(rows["actor_layout"]) == {"dp_shard2"}
        single = read_records(one / "records" / f"{run}.parquet")
        assert list(rows["reward_mean"]) == list(single["reward_mean"])  # the same rollouts
        assert (rows["loss"] - single["loss"]).abs().max() < 1e-6
        assert (single["drift_rms"] > 1e-4).all()  # the weights moved
        assert ((rows["drift_rms"] - single["drift_rms"]).abs() < 1e-3 * single["drift_rms"]).all()
    logs = sorted(p.name for p in (jobs_folder(folder) / "slurm").glob("*_log.out"))
    assert len(logs) == 2 and {n.split("_")[-2] for n in logs} == {"0", "1"}, logs
