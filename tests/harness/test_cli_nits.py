"""Issue 26, defect 9: the nits users hit (speedup.md's layout column, `<bool>` on flags, FAIL rows that are
expected, stray temp files of killed writers, `pf-bench run`'s progress)."""

from __future__ import annotations

import os
import time

import pandas as pd
import pytest
from typer.testing import CliRunner

from harness.cli import app
from harness.figures.tables import speedup_frame
from harness.safe_fs import atomic_write

STALE_TMP_S = 60.0  # harness.safe_fs.STALE_TMP_S

runner = CliRunner()
TINY = ["--override", "dim=32", "--override", "n_heads=2", "--override", "n_layers=2", "--override",
        "vocab_size=128"]  # fmt: skip


def test_speedup_table_has_a_layout_column():
    """A padded and a packed cell of the same configuration read as duplicated rows without it."""
    base = {
        "spec": "s", "model": "m", "dtype": "fp32", "device": "cpu", "tp": 1, "cp": 1, "pp": 1, "dp": 1,
        "ep": 1, "status": "ok", "error": None, "repeats": 3, "compile": False, "offload": False,
        "ac": "none", "microbatch": 1, "prefix_len": 64, "suffix_len": 16, "n": 4, "prefix_ratio": 0.8,
    }  # fmt: skip
    rows = []
    for layout, t in (("padded", 1.0), ("packed", 0.8)):
        cell = {**base, "layout": layout, "cell_id": layout}
        rows += [
            {**cell, "system": "baseline", "step_time_s": 2.0},
            {**cell, "system": "prefixflow", "step_time_s": t},
        ]
    table = speedup_frame(pd.DataFrame(rows))
    assert sorted(table["layout"]) == ["packed", "padded"], table.columns


@pytest.mark.parametrize("command", [["run"], ["replay"], ["sweep"], ["align"], ["rl"]])
def test_help_shows_no_type_on_flags(command):
    res = runner.invoke(app, [*command, "--help"])
    assert res.exit_code == 0 and "<bool>" not in res.output, res.output


def test_align_controls_say_their_fail_rows_are_expected():
    res = runner.invoke(
        app,
        ["align", *TINY, "--steps", "1", "--dtype", "fp64", "--prefix-len", "8", "--suffix-len", "4", "--n", "2",
         "--microbatch", "1", "--controls"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "FAIL" in res.output and "FAIL is expected" in " ".join(res.output.split()), res.output


def test_rl_smoke_says_its_false_rows_are_expected(tmp_path, monkeypatch):
    from support import REPO

    import harness.figures.fig8 as fig8
    import harness.rl.run as rl_run

    monkeypatch.setattr(rl_run, "run_claim2", lambda *a, **k: tmp_path)
    monkeypatch.setattr(rl_run, "collected", lambda folder: pd.DataFrame())
    summary = pd.DataFrame([{"check": "reward rise", "value": -0.1, "target": ">= 0.2", "pass": False}])
    monkeypatch.setattr(fig8, "claim2_summary", lambda df: summary)
    spec = REPO / "experiments" / "claim2.yaml"
    res = runner.invoke(app, ["rl", str(spec), "--preset", "smoke", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "False rows are expected here" in " ".join(res.output.split()), res.output
    res = runner.invoke(app, ["rl", str(spec), "--preset", "cpu", "--out", str(tmp_path)])
    assert "expected" not in res.output


def test_a_killed_writers_temp_files_go_on_the_next_write(tmp_path):
    """`.NAME.<hex>.tmp` files stayed for ever; the next write of NAME removes those older than a minute
    (a live writer's temp is fresh, another file's temp and a link are left alone)."""
    old = time.time() - STALE_TMP_S - 5
    stale = tmp_path / ".cell.parquet.0123456789ab.tmp"
    fresh = tmp_path / ".cell.parquet.ba9876543210.tmp"
    other = tmp_path / ".other.parquet.0123456789ab.tmp"
    for p in (stale, fresh, other):
        p.write_bytes(b"x")
    os.utime(stale, (old, old))
    os.utime(other, (old, old))
    link = tmp_path / ".cell.parquet.aaaaaaaaaaaa.tmp"
    link.symlink_to(other)
    atomic_write(tmp_path / "cell.parquet", lambda fh: fh.write(b"data"), root=tmp_path)
    assert (tmp_path / "cell.parquet").read_bytes() == b"data"
    assert not stale.exists() and fresh.exists() and other.exists() and link.is_symlink()


def test_run_prints_a_progress_line_per_system_and_repeat():
    """`pf-bench run` was silent for minutes."""
    res = runner.invoke(
        app,
        ["run", "--model", "llama3:debugmodel", *TINY, "--prefix-len", "8", "--suffix-len", "4", "--n", "2",
         "--warmup", "1", "--repeats", "2"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    for needle in (
        "building baseline",
        "building prefixflow",
        "warm-up 1/1 baseline",
        "repeat 2/2 prefixflow",
    ):
        assert needle in text, res.output
