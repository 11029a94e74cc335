"""A two-rank cell through the local Slurm: one multi-task job (one task per rank), rank 0's record."""

from __future__ import annotations

import json

from support.slurm_marks import SLURM_JOB_MARKS

from harness.execute.executors import SlurmExecutor
from harness.records import read_records
from harness.safe_fs import jobs_folder
from harness.spec.load import expand, parse_spec
from harness.spec.schema import ExecutorSettings

pytestmark = SLURM_JOB_MARKS

SPEC = {
    "name": "pslurm",
    "warmup": 0,
    "repeats": 1,
    "axes": {
        "models": [{"name": "llama3:debugmodel", "overrides": {"dim": 64, "n_layers": 1, "vocab_size": 128}}],
        "lengths": [{"prefix": 16, "suffix": 4}],
        "n": [2],
        "parallel": [{"tp": 2}],
    },
}


def test_a_two_rank_cell_runs_as_one_two_task_job(tmp_path):
    (cell,) = expand(parse_spec(SPEC))
    settings = ExecutorSettings(max_jobs=1, timeout_min=10, overcommit=True, mem_gb=4)
    done = {}
    SlurmExecutor(settings, wait_timeout_s=900).run(
        [cell], tmp_path, lambda c, s: done.__setitem__(c.cell_id, s)
    )
    df = read_records(tmp_path / f"{cell.cell_id}.parquet")
    assert done == {cell.cell_id: "ok"}, df["error"].tolist()
    assert set(df["parallel_layout"]) == {"tp2"}
    assert all(len(json.loads(v)) == 2 for v in df["step_time_s_per_rank"])
    # one job, two tasks: submitit wrote a log per task
    logs = sorted(p.name for p in (jobs_folder(tmp_path) / "slurm").glob("*_log.out"))
    assert len(logs) == 2 and {n.split("_")[-2] for n in logs} == {"0", "1"}, logs
