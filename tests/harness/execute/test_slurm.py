"""The smoke spec through a real Slurm (scripts/slurm_up.sh) matches the local executor's cells and statuses."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

from support import REPO
from support.slurm_marks import SLURM_JOB_MARKS
from typer.testing import CliRunner

from harness.cli import app
from harness.records import collect
from harness.safe_fs import jobs_folder
from harness.spec.load import expand, load_spec

pytestmark = SLURM_JOB_MARKS
SMOKE = REPO / "experiments" / "smoke.yaml"
runner = CliRunner()


def _sweep(executor: str, out: Path) -> str:
    res = runner.invoke(
        app, ["sweep", str(SMOKE), "--executor", executor, "--out", str(out)], catch_exceptions=False
    )
    assert res.exit_code == 0, res.output
    return res.output


def test_cluster_is_up():
    out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30)
    states = set(out.stdout.split())
    assert out.returncode == 0 and states & {"idle", "mix", "alloc"}, (
        f"sinfo found but the cluster is not usable: {out.stdout!r} {out.stderr!r}; run `bash scripts/slurm_up.sh`"
    )


def test_smoke_on_slurm_matches_local(tmp_path):
    cells = expand(load_spec(SMOKE))
    slurm_out = _sweep("slurm", tmp_path / "slurm")
    assert "(slurm)" in slurm_out and f"ran {len(cells)}" in slurm_out
    _sweep("local", tmp_path / "local")
    on_slurm, local = collect(tmp_path / "slurm"), collect(tmp_path / "local")
    key = ["cell_id", "system", "status"]
    assert sorted(map(tuple, on_slurm[key].values)) == sorted(map(tuple, local[key].values))
    assert sorted(on_slurm["cell_id"].unique()) == sorted(c.cell_id for c in cells)
    assert set(on_slurm["status"]) == {"ok"}, on_slurm[["cell_id", "system", "error"]]
    # the jobs really went through Slurm: submitit wrote its array logs and pickles, all in the private
    # job folder (0700, outside --out); nothing that is ever unpickled lies in the results folder
    private = jobs_folder(tmp_path / "slurm" / "smoke")
    assert list((private / "slurm").glob("*_0_log.out")) and list((private / "slurm").glob("*.pkl"))
    assert stat.S_IMODE(private.stat().st_mode) == 0o700 and not private.is_relative_to(tmp_path)
    assert not list((tmp_path / "slurm").rglob("*.pkl"))
    # a rerun on Slurm submits nothing
    assert "ran 0" in _sweep("slurm", tmp_path / "slurm")


def test_cell_past_its_slurm_time_limit_is_recorded_as_timeout(tmp_path):
    spec = tmp_path / "slow.yaml"
    spec.write_text(
        "name: slow\nwarmup: 0\nrepeats: 100000000\n"
        "axes:\n  models: [{name: 'llama3:debugmodel', overrides: {dim: 32, n_layers: 2, n_heads: 2, vocab_size: 128}}]\n"
        "  lengths: [{prefix: 12, suffix: 4}]\n  n: [2]\n"
        "executor: {timeout_min: 1, max_jobs: 1}\n"
    )
    res = runner.invoke(
        app,
        ["sweep", str(spec), "--executor", "slurm", "--out", str(tmp_path / "out")],
        catch_exceptions=False,
    )
    assert res.exit_code == 1 and "1 of 1 cells failed {'timeout': 1}" in res.output, res.output
    df = collect(tmp_path / "out")
    assert len(df) == 2 and set(df["status"]) == {"timeout"}, df[["system", "status", "error"]]
    assert df["error"].str.contains("timed-out").all()
