"""Parquet records: schema, atomic writes, collect, status summary."""

from __future__ import annotations

import math

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness import records
from harness.records import (
    COLUMNS,
    STATUSES,
    cell_status,
    collect,
    read_records,
    summarize,
    to_table,
    write_records,
    write_table,
)


def _rec(cell="c1", system="baseline", status="ok", **extra):
    return {
        "cell_id": cell,
        "spec": "s",
        "system": system,
        "status": status,
        "timestamp": "2026-01-01T00:00:00",
        "prefix_len": 8,
        "suffix_len": 4,
        "n": 2,
        "microbatch": None,
        "step_time_s": 0.5,
        "phase_a_s": math.nan,
        **extra,
    }


REQUIRED = [
    "cell_id",
    "spec",
    "git_rev",
    "timestamp",
    "host",
    "device",
    "model",
    "dtype",
    "prefix_len",
    "suffix_len",
    "n",
    "prefix_ratio",
    "layout",
    "microbatch",
    "compile",
    "ac",
    "offload",
    "tp",
    "cp",
    "pp",
    "dp",
    "ep",
    "system",
    "status",
    "error",
    "repeats",
    "step_time_s",
    "step_time_min_s",
    "step_time_max_s",
    "phase_a_s",
    "phase_b_s",
    "phase_c_s",
    "peak_mem_bytes",
    "peak_mem_phase_b_bytes",
    "mem_meter",
    "tokens",
]


def test_schema_has_every_issue_column():
    assert set(REQUIRED) <= set(COLUMNS)


def test_roundtrip_types_and_extras(tmp_path):
    path = write_records(tmp_path / "c1.parquet", [_rec(model_flops=1e9), _rec(system="prefixflow")])
    df = read_records(path)
    assert list(df["system"]) == ["baseline", "prefixflow"]
    assert df["prefix_len"].dtype == "int64"
    assert pd.isna(df["microbatch"]).all() and pd.isna(df["phase_a_s"]).all()
    assert df.loc[0, "model_flops"] == 1e9 and pd.isna(df.loc[1, "model_flops"])
    assert (path.stat().st_mode & 0o777) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["c1.parquet"]  # no temp file left


def test_to_table_rejects_bad_records():
    with pytest.raises(ValueError, match="status"):
        to_table([_rec(status="done")])
    with pytest.raises(ValueError, match="required"):
        to_table([{"cell_id": "c", "spec": "s", "status": "ok"}])
    with pytest.raises(ValueError, match="no records"):
        to_table([])


def test_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = write_records(tmp_path / "c1.parquet", [_rec(step_time_s=1.0)])

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(records.pq, "write_table", boom)
    with pytest.raises(OSError, match="disk full"):
        write_records(path, [_rec(step_time_s=2.0)])
    monkeypatch.undo()
    assert read_records(path)["step_time_s"].tolist() == [1.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c1.parquet"]


def test_collect_tolerates_extras_garbage_and_temp_files(tmp_path):
    write_records(tmp_path / "a" / "c1.parquet", [_rec(compile_time_s=3.0)])
    write_records(tmp_path / "a" / "c2.parquet", [_rec(cell="c2", ideal_speedup=1.5)])
    write_records(tmp_path / "b" / "c3.parquet", [_rec(cell="c3", status="error", error="Traceback ...")])
    (tmp_path / "a" / "broken.parquet").write_bytes(b"not parquet")
    (tmp_path / "a" / ".c4.parquet.x.tmp").write_bytes(b"half")
    write_records(tmp_path / "a" / "_jobs" / "ignored.parquet", [_rec(cell="zz")])
    with pytest.warns(UserWarning, match="broken.parquet"):
        df = collect(tmp_path)
    assert sorted(df["cell_id"]) == ["c1", "c2", "c3"]
    assert {"compile_time_s", "ideal_speedup"} <= set(df.columns)
    out = write_table(df, tmp_path / "all.parquet")
    assert len(pq.read_table(out)) == 3
    with pytest.warns(UserWarning):
        assert len(collect(tmp_path, exclude=[out])) == 3
        assert len(collect(tmp_path)) == 3  # the collected copy deduplicates against its sources


def test_duplicates_keep_the_newest(tmp_path):
    write_records(tmp_path / "x" / "c1.parquet", [_rec(status="error", timestamp="2026-01-01T00:00:00")])
    write_records(tmp_path / "y" / "c1.parquet", [_rec(status="ok", timestamp="2026-01-02T00:00:00")])
    df = collect(tmp_path)
    assert df["status"].tolist() == ["ok"]


def test_collect_empty_folder(tmp_path):
    df = collect(tmp_path)
    assert df.empty and set(REQUIRED) <= set(df.columns)


def test_status_summary_and_worst_status():
    df = pd.DataFrame(
        [_rec(), _rec(system="prefixflow", status="oom"), _rec(cell="c2"), _rec(cell="c3", status="timeout")]
    )
    s = summarize(df).set_index("spec")
    # cells by their worst status (c1: ok + oom -> oom), systems and rows apart
    assert s.loc["s", "cells"] == 3 and s.loc["s", "ok"] == 1 and s.loc["s", "oom"] == 1
    assert s.loc["s", "timeout"] == 1 and s.loc["s", "error"] == 0
    assert s.loc["s", "systems"] == 2 and s.loc["s", "rows"] == 4
    assert cell_status(df[df.cell_id == "c1"]) == "oom"
    assert cell_status(pd.DataFrame([_rec(status="timeout"), _rec(status="error")])) == "error"


def test_records_written_before_the_parallel_columns_read_as_single_process(tmp_path):
    old = to_table([_rec()]).drop_columns(["dp_replicate", "dp_shard"])  # a record from before issue 8
    pq.write_table(old, tmp_path / "c1.parquet")
    df = read_records(tmp_path / "c1.parquet")
    assert list(df["dp_replicate"]) == [1] and list(df["dp_shard"]) == [1]
    assert len(collect(tmp_path)) == 1
    pq.write_table(old.drop_columns(["tp"]), tmp_path / "c1.parquet")  # any other core column: refused
    with pytest.raises(records.InvalidRecord, match="column 'tp' missing"):
        read_records(tmp_path / "c1.parquet")


def test_status_of_the_committed_results_counts_cells_not_rows():
    """Every cell has exactly one status (claim2 once read "cells 20, ok 1482"); counts print as integers."""
    from support import REPO
    from typer.testing import CliRunner

    from harness.cli import app
    from harness.sweep import status_table

    table = status_table(REPO / "results")
    assert len(table) >= 5
    by_status = table[list(STATUSES)].sum(axis=1)
    assert (by_status == table["cells"]).all(), table
    assert (table["rows"] >= table["cells"]).all() and (table["systems"] >= 1).all()
    res = CliRunner().invoke(app, ["status", str(REPO / "results")])
    assert res.exit_code == 0 and "cells recorded" in res.output and ".0 cells" not in res.output, res.output


def _planted(tmp_path, column: str, value: float):
    """A committed ok record with one value replaced, under its own name in a results-like folder."""
    from harness.records import record_files

    source = next(p for p in record_files("results") if (pd.read_parquet(p)["status"] == "ok").all())
    table = pq.read_table(source)
    values = table.column(column).to_pylist()
    values[0] = value
    table = table.set_column(table.schema.get_field_index(column), column, pa.array(values, pa.float64()))
    folder = tmp_path / "results" / "planted"
    folder.mkdir(parents=True)
    pq.write_table(table, folder / source.name)
    return folder / source.name


@pytest.mark.parametrize("column, value", [("step_time_s", float("nan")), ("peak_mem_bytes", float("inf"))])
def test_an_ok_record_with_non_finite_values_is_not_counted(tmp_path, column, value):
    """Issue 36.9: a planted record, status ok with NaN times, counted as ok in pf-bench status and tables."""
    from harness.records import InvalidRecord, collect, read_records, summarize

    path = _planted(tmp_path, column, value)
    with pytest.raises(InvalidRecord, match=rf"status 'ok' has {column} = {value} .not finite."):
        read_records(path)
    problems: list[str] = []
    assert collect(tmp_path / "results", problems=problems).empty and str(path) in problems[0]
    assert summarize(collect(tmp_path / "results", problems=[])).empty
