"""Executors and reliability: crash -> error, timeout -> timeout, hard crash, SIGKILL mid-sweep + rerun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from support import REPO

from harness.execute import executors
from harness.execute.executors import DebugExecutor, LocalExecutor, make_executor, record_path
from harness.records import collect, read_records
from harness.spec.cell import Cell, ModelSpec
from harness.spec.load import expand, load_spec
from harness.spec.schema import ExecutorSettings

TINY = ModelSpec(
    name="llama3:debugmodel", overrides={"dim": 32, "n_layers": 2, "n_heads": 2, "vocab_size": 128}
)


def _cell(**over) -> Cell:
    base = dict(spec="t", model=TINY, prefix_len=12, suffix_len=4, n=2, warmup=0, repeats=1, timeout_min=2.0)
    return Cell(**{**base, **over})


def _collect_done(folder: Path, cells, executor) -> dict[str, str]:
    seen: dict[str, str] = {}
    executor.run(cells, folder, lambda c, s: seen.__setitem__(c.cell_id, s))
    return seen


def test_debug_executor_runs_in_process(tmp_path):
    cell = _cell()
    assert _collect_done(tmp_path, [cell], DebugExecutor()) == {cell.cell_id: "ok"}
    df = read_records(record_path(tmp_path, cell))
    assert sorted(df["system"]) == ["baseline", "prefixflow"]
    assert (df["status"] == "ok").all() and (df["step_time_s"] > 0).all()
    assert (df["mem_meter"] == "cpu-live-bytes").all() and (df["peak_mem_bytes"] > 0).all()
    pf = df.set_index("system").loc["prefixflow"]
    assert pf["phase_a_s"] > 0 and pf["phase_b_s"] > 0 and pf["phase_c_s"] > 0
    assert df["tokens"].tolist() == [2 * 16, 2 * 16]


def test_local_crashing_cell_is_recorded_with_traceback(tmp_path):
    bad = _cell(model=ModelSpec(name="llama3:nosuchflavor"))
    good = _cell(n=3)
    seen = _collect_done(tmp_path, [bad, good], LocalExecutor(max_jobs=2))
    assert seen == {bad.cell_id: "error", good.cell_id: "ok"}
    df = read_records(record_path(tmp_path, bad))
    assert (df["status"] == "error").all() and len(df) == 2
    # a model that cannot be built is found by the check before any allocation (harness.run.memory): its
    # record holds the one-line reason, not a traceback (issue 26)
    assert df["error"].str.contains("unknown llama3 flavor 'nosuchflavor'").all()
    assert not df["error"].str.contains("Traceback").any()


def test_local_timeout_is_recorded(tmp_path):
    slow = _cell(repeats=1_000_000, timeout_min=0.1)
    t0 = time.monotonic()
    seen = _collect_done(tmp_path, [slow], LocalExecutor(max_jobs=1))
    assert seen == {slow.cell_id: "timeout"}
    assert time.monotonic() - t0 < 30
    df = read_records(record_path(tmp_path, slow))
    assert (df["status"] == "timeout").all() and df["error"].str.contains("timeout").all()


def test_local_hard_crash_without_record(tmp_path, monkeypatch):
    script = tmp_path / "crash.py"
    script.write_text("import os, sys\nprint('segfault-ish', file=sys.stderr)\nos._exit(3)\n")
    monkeypatch.setattr(executors, "WORKER_ARGV", [sys.executable, str(script)])
    cell = _cell()
    assert _collect_done(tmp_path, [cell], LocalExecutor(max_jobs=1)) == {cell.cell_id: "error"}
    err = read_records(record_path(tmp_path, cell))["error"].iloc[0]
    assert "code 3" in err and "segfault-ish" in err


def test_an_impossible_parallel_layout_is_an_error_record_before_any_launch(tmp_path):
    # expert parallelism borrows ranks: ep must divide dp_shard*cp*tp
    cell = _cell(parallel={"ep": 4, "tp": 2})
    assert _collect_done(tmp_path, [cell], DebugExecutor()) == {cell.cell_id: "error"}
    errors = read_records(record_path(tmp_path, cell))["error"]
    assert errors.str.contains("ep=4 must divide").all(), errors.tolist()


def test_make_executor_rejects_unknown_kind():
    with pytest.raises(ValueError, match="local, slurm, debug"):
        make_executor("k8s", ExecutorSettings())
    assert make_executor("local", ExecutorSettings(max_jobs=3)).max_jobs == 3


def _kill_spec(tmp_path: Path) -> Path:
    spec = {
        "name": "killme",
        "warmup": 0,
        "repeats": 1,
        "axes": {
            "models": [{"name": "llama3:debugmodel", "overrides": dict(TINY.overrides)}],
            "lengths": [{"prefix": 12, "suffix": 4}],
            "n": [2, 3, 4, 5],
        },
        "executor": {"max_jobs": 2, "timeout_min": 2},
    }
    path = tmp_path / "killme.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _sweep(spec: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "harness.cli", "sweep", str(spec), "--out", str(out)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
def test_sigkill_midway_then_rerun_records_every_cell_once(tmp_path):
    spec_path, out = _kill_spec(tmp_path), tmp_path / "out"
    cells = expand(load_spec(spec_path))
    folder = out / "killme"
    proc = _sweep(spec_path, out)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(folder.glob("*.parquet")):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    first = {p.name: p.stat().st_mtime_ns for p in folder.glob("*.parquet")}
    assert 0 < len(first) < len(cells)
    time.sleep(2.0)  # orphaned workers would keep writing; they must have died with the sweep
    assert {p.name for p in folder.glob("*.parquet")} == set(first)

    rerun = _sweep(spec_path, out)
    text, _ = rerun.communicate(timeout=180)
    assert rerun.returncode == 0, text
    assert f"{len(first)} recorded, {len(cells) - len(first)} to run" in text
    for name, mtime in first.items():  # finished cells are not run again
        assert (folder / name).stat().st_mtime_ns == mtime
    df = collect(out)
    assert sorted(df["cell_id"].unique()) == sorted(c.cell_id for c in cells)
    assert len(df) == 2 * len(cells) and not df.duplicated(["cell_id", "system"]).any()
    for c in cells:
        assert len(read_records(record_path(folder, c))) == 2
    assert set(df["status"]) == {"ok"}
    # a worker killed mid-write may leave a hidden temp file (removed by a later sweep once stale);
    # it is never a record: collect() above saw exactly one readable record per cell
    leftovers = [p.name for p in folder.iterdir() if p.suffix == ".tmp"]
    assert all(name.startswith(".") for name in leftovers), leftovers


def _plan_spec(tmp_path: Path):
    path = _kill_spec(tmp_path)
    return load_spec(path)


def test_plan_skips_recorded_cells_and_retry_failed_reruns_them(tmp_path):
    from harness.run.columns import failed_records
    from harness.sweep import plan, spec_folder

    spec = _plan_spec(tmp_path)
    cells = expand(spec)
    folder = spec_folder(tmp_path / "out", spec.name)
    from harness.records import write_records

    write_records(record_path(folder, cells[0]), failed_records(cells[0], "ok", ""))
    write_records(record_path(folder, cells[1]), failed_records(cells[1], "error", "Traceback"))
    (folder / f"{cells[2].cell_id}.parquet").write_bytes(b"torn write")  # unreadable -> rerun
    p = plan(spec, tmp_path / "out")
    assert [c.cell_id for c in p.todo] == [c.cell_id for c in cells[2:]]
    assert p.done == {cells[0].cell_id: "ok", cells[1].cell_id: "error"}
    p = plan(spec, tmp_path / "out", retry_failed=True)
    assert [c.cell_id for c in p.todo] == [c.cell_id for c in cells[1:]]


def test_one_sweep_per_folder_and_stale_temps_are_removed(tmp_path):
    from harness.sweep import STALE_TMP_S, run_sweep, spec_folder, status_table, sweep_lock

    spec = _plan_spec(tmp_path)
    folder = spec_folder(tmp_path / "out", spec.name)
    folder.mkdir(parents=True)
    stale, fresh = folder / ".dead.parquet.x.tmp", folder / ".live.parquet.y.tmp"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"y")
    old = time.time() - STALE_TMP_S - 5
    os.utime(stale, (old, old))

    class Nothing:
        def run(self, cells, folder, on_done):
            for c in cells:
                executors._finish(c, record_path(folder, c), "error", "not run")
                on_done(c, "error")

    with sweep_lock(folder):
        with pytest.raises(RuntimeError, match="another sweep is running"):
            run_sweep(spec, tmp_path / "out", Nothing())
    p = run_sweep(spec, tmp_path / "out", Nothing())
    assert not stale.exists() and fresh.exists()
    assert set(p.done.values()) == {"error"} and len(p.done) == len(expand(spec))
    st = status_table(tmp_path / "out").set_index("spec")
    assert st.loc["killme", "missing"] == 0 and st.loc["killme", "error"] == len(expand(spec))
    assert st.loc["killme", "rows"] == 2 * len(expand(spec))  # two systems per cell


def test_a_relative_out_given_outside_the_repository_gets_its_records(tmp_path, monkeypatch):
    """`cd elsewhere && pf-bench sweep SPEC --out res`: the worker runs in the repository root, so a relative
    record path would land in the repository and every cell would read as 'exited 0 without a record'."""
    monkeypatch.chdir(tmp_path)
    cell = _cell()
    assert _collect_done(Path("res") / "t", [cell], LocalExecutor(max_jobs=1)) == {cell.cell_id: "ok"}
    assert read_records(tmp_path / "res" / "t" / f"{cell.cell_id}.parquet")["status"].eq("ok").all()
    assert not (REPO / "res").exists()
