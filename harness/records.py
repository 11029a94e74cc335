"""Parquet records: one file per cell (one row per system), atomic writes, collect, status."""

from __future__ import annotations

import math
import os
import stat
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from harness.safe_fs import atomic_write

STATUSES = ("ok", "error", "oom", "timeout", "refused")  # refused: the memory check said it cannot fit
RECORD_SUFFIX = ".parquet"
ESTIMATE_METER = "fake-live-bytes"  # the mem_meter of an estimated record (harness.estimate): nothing ran

# Core columns and their types; records may carry extra columns (model_flops, compile_time_s, ...).
SCHEMA = pa.schema(
    [
        ("cell_id", pa.string()),
        ("spec", pa.string()),
        ("git_rev", pa.string()),
        ("timestamp", pa.string()),
        ("host", pa.string()),
        ("device", pa.string()),
        ("model", pa.string()),
        ("model_overrides", pa.string()),
        ("dtype", pa.string()),
        ("prefix_len", pa.int64()),
        ("suffix_len", pa.int64()),
        ("n", pa.int64()),
        ("prefix_ratio", pa.float64()),
        ("suffix_spread", pa.float64()),
        ("layout", pa.string()),
        ("microbatch", pa.int64()),
        ("compile", pa.bool_()),
        ("ac", pa.string()),
        ("offload", pa.bool_()),
        ("dp_replicate", pa.int64()),
        ("dp_shard", pa.int64()),
        ("tp", pa.int64()),
        ("cp", pa.int64()),
        ("pp", pa.int64()),
        ("dp", pa.int64()),
        ("ep", pa.int64()),
        ("world_size", pa.int64()),
        ("system", pa.string()),
        ("status", pa.string()),
        ("error", pa.string()),
        ("warmup", pa.int64()),
        ("repeats", pa.int64()),
        ("seed", pa.int64()),
        ("step_time_s", pa.float64()),
        ("step_time_min_s", pa.float64()),
        ("step_time_max_s", pa.float64()),
        ("phase_a_s", pa.float64()),
        ("phase_b_s", pa.float64()),
        ("phase_c_s", pa.float64()),
        ("peak_mem_bytes", pa.float64()),
        ("peak_mem_phase_b_bytes", pa.float64()),
        ("mem_meter", pa.string()),
        ("tokens", pa.int64()),
        ("config", pa.string()),
    ]
)
COLUMNS = tuple(SCHEMA.names)
# Core columns added after records were committed, with the value every older record had: those records
# (all single-process: multi-rank cells were errors then) read with it filled in.
ADDED_COLUMNS = {"dp_replicate": 1, "dp_shard": 1}
_REQUIRED = ("cell_id", "spec", "system", "status")
RECORD_MAX_BYTES = 64 * 2**20  # a cell's record is a few kB; anything this big is not one
RECORD_MAX_ROWS = 100_000  # a capacity search records one row per probe and system


class InvalidRecord(ValueError):
    """A record file failed verification; the message names the file and what is wrong."""


def _clean(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def to_table(records: list[dict[str, Any]]) -> pa.Table:
    """Build a table: core columns typed by SCHEMA (missing -> null), extra columns inferred."""
    if not records:
        raise ValueError("no records to write")
    for rec in records:
        missing = [c for c in _REQUIRED if not rec.get(c)]
        if missing:
            raise ValueError(f"record lacks required columns {missing}")
        if rec["status"] not in STATUSES:
            raise ValueError(f"status {rec['status']!r} not one of {STATUSES}")
    extras = sorted({k for rec in records for k in rec} - set(COLUMNS))
    arrays, fields = [], []
    for field in SCHEMA:
        arrays.append(pa.array([_clean(rec.get(field.name)) for rec in records], type=field.type))
        fields.append(field)
    for name in extras:
        arr = pa.array([_clean(rec.get(name)) for rec in records])
        if pa.types.is_null(arr.type):
            arr = arr.cast(pa.float64())
        arrays.append(arr)
        fields.append(pa.field(name, arr.type))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def _atomic_write(table: pa.Table, path: str | Path, root: str | Path | None = None) -> Path:
    """Temp file in the same folder, fsync, rename; no link below ``root`` is followed (harness.safe_fs)."""
    return atomic_write(path, lambda fh: pq.write_table(table, fh), root=root)


def write_records(path: str | Path, records: list[dict[str, Any]], root: str | Path | None = None) -> Path:
    """Write records atomically: a temp file in the same folder, fsync, then os.replace. ``root``: the
    results folder; no directory between it and ``path`` may be a link."""
    return _atomic_write(to_table(records), path, root)


def write_cell_records(
    folder: str | Path, records: list[dict[str, Any]], root: str | Path | None = None
) -> list[Path]:
    """Write records one file per cell (``FOLDER/<cell_id>.parquet``), as :func:`read_records` verifies them."""
    by_cell: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        by_cell.setdefault(str(rec.get("cell_id")), []).append(rec)
    return [
        write_records(Path(folder) / f"{cid}{RECORD_SUFFIX}", recs, root) for cid, recs in by_cell.items()
    ]


def _read_bounded(path: Path) -> bytes:
    """The bytes of a regular file no bigger than RECORD_MAX_BYTES (a link, FIFO or device is refused)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise InvalidRecord(f"{path}: cannot open ({e.strerror})") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidRecord(f"{path}: not a regular file")
        if st.st_size > RECORD_MAX_BYTES:
            raise InvalidRecord(f"{path}: {st.st_size} bytes, more than a record can be ({RECORD_MAX_BYTES})")
        return fh.read(RECORD_MAX_BYTES + 1)


def verify_table(table: pa.Table, name: str, source: str = "<table>") -> None:
    """Raise InvalidRecord unless ``table`` is the record file ``name``: every core column with its type,
    at least one row, known statuses, and each row's cell id (or, for the probe rows of a capacity search,
    its ``search_id``) equal to ``name``."""
    problems = []
    for field in SCHEMA:
        if field.name not in table.schema.names:
            if field.name not in ADDED_COLUMNS:
                problems.append(f"column {field.name!r} missing")
        elif not table.schema.field(field.name).type.equals(field.type):
            problems.append(
                f"column {field.name!r} is {table.schema.field(field.name).type}, not {field.type}"
            )
        if len(problems) >= 3:
            break
    if problems:
        raise InvalidRecord(f"{source}: not a pf-bench record ({'; '.join(problems)})")
    if table.num_rows == 0:
        raise InvalidRecord(f"{source}: no rows")
    for col in _REQUIRED:
        if table.column(col).null_count:
            raise InvalidRecord(f"{source}: column {col!r} has empty values")
    bad = sorted(set(table.column("status").to_pylist()) - set(STATUSES))
    if bad:
        raise InvalidRecord(f"{source}: status {_short(bad[0])} is not one of {', '.join(STATUSES)}")
    _check_ok_rows_finite(table, source)
    ids = table.column("cell_id").to_pylist()
    searches = (
        table.column("search_id").to_pylist() if "search_id" in table.schema.names else [None] * len(ids)
    )
    other = sorted({c for c, s in zip(ids, searches, strict=True) if name not in (c, s)})
    if other:
        raise InvalidRecord(
            f"{source}: holds cell {_short(other[0])}, not {name!r} (a record copied or moved under "
            "another cell's name)"
        )


def _check_ok_rows_finite(table: pa.Table, source: str) -> None:
    """An ``ok`` row's numbers are measurements: NaN or inf in any float column (a loss, a time) is refused
    (empty values are fine: not measured)."""
    ok = pc.equal(table.column("status"), "ok")
    for field in table.schema:
        if not pa.types.is_floating(field.type):
            continue
        column = table.column(field.name)
        bad = pc.and_(ok, pc.fill_null(pc.invert(pc.is_finite(column)), False))
        if pc.any(bad).as_py():
            raise InvalidRecord(
                f"{source}: a row with status 'ok' has {field.name} = {_short(pc.filter(column, bad)[0].as_py())}"
                " (not finite); an ok record holds measured, finite values"
            )


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_records(path: str | Path) -> pd.DataFrame:
    """Read and verify one record file (see :func:`verify_table`; the cell id is the file name).
    Raises InvalidRecord naming the file and the problem."""
    path = Path(path)
    data = _read_bounded(path)
    try:
        meta = pq.ParquetFile(pa.BufferReader(data)).metadata
        size = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        if meta.num_rows > RECORD_MAX_ROWS or size > RECORD_MAX_BYTES * 8:
            raise InvalidRecord(f"{path}: {meta.num_rows} rows, {size} bytes unpacked; not a cell's record")
        table = pq.read_table(pa.BufferReader(data))
        verify_table(table, path.name.removesuffix(RECORD_SUFFIX), str(path))
        df = table.to_pandas()
        for col, value in ADDED_COLUMNS.items():
            if col not in df.columns:
                df[col] = value
        return df
    except InvalidRecord:
        raise
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise InvalidRecord(f"{path}: not a readable Parquet file ({_short(str(e), 120)})") from None


def record_files(root: str | Path, exclude: Iterable[str | Path] = ()) -> list[Path]:
    """Every record file under ``root``, skipping hidden/underscore folders and temp files."""
    root = Path(root)
    skip = {Path(p).resolve() for p in exclude}
    if root.is_file():
        return [root]
    out = []
    for p in sorted(root.rglob(f"*{RECORD_SUFFIX}")):
        rel = p.relative_to(root).parts
        if any(part.startswith((".", "_")) for part in rel) or p.resolve() in skip:
            continue
        out.append(p)
    return out


def collect(
    root: str | Path, exclude: Iterable[str | Path] = (), problems: list[str] | None = None
) -> pd.DataFrame:
    """Concatenate all verified records under ``root`` (unknown extra columns kept); a file that fails
    verification is skipped and named in ``problems`` (or a warning). Duplicates of (spec, cell_id, system)
    keep the newest timestamp."""
    frames = []
    for p in record_files(root, exclude):
        try:
            frames.append(read_records(p))
        except InvalidRecord as e:  # a foreign or damaged file must not hide every other record
            if problems is None:
                warnings.warn(f"skipping {e}", stacklevel=2)
            else:
                problems.append(str(e))
    if not frames:
        return pd.DataFrame(columns=list(COLUMNS))
    df = pd.concat(frames, ignore_index=True, sort=False)
    for col in COLUMNS:
        if col not in df.columns:
            df[col] = None
    df = df.sort_values("timestamp", kind="stable")
    # an alignment cell has one row per system, step and quantity (Table 3); a Claim-2 record one per system,
    # step and run (a divergence record's run is its pair of runs), under one file name in every preset
    extra = ("step", "quantity", "preset", "run")
    key = ["spec", "cell_id", "system", *(c for c in extra if c in df.columns)]
    df = df.drop_duplicates(subset=key, keep="last")
    return df.reset_index(drop=True)


def write_table(df: pd.DataFrame, path: str | Path, root: str | Path | None = None) -> Path:
    """Write a collected DataFrame atomically."""
    return _atomic_write(pa.Table.from_pandas(df, preserve_index=False), path, root)


def cell_status(df: pd.DataFrame) -> str:
    """The worst status among a cell's rows (ok < oom < refused < timeout < error). A finished capacity-frontier
    search (every row a probe, with ``budget_bytes``) is ``ok``: over-budget (``oom``) probes are how it
    finds the boundary; it is only as bad as its worst non-``oom`` row."""
    order = {"ok": 0, "oom": 1, "refused": 2, "timeout": 3, "error": 4}
    statuses = df["status"]
    if "budget_bytes" in df.columns and df["budget_bytes"].notna().all():
        statuses = statuses.replace("oom", "ok")
    return max(statuses, key=lambda s: order.get(s, 4))


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Per spec: number of cells, cells by status (a cell's worst, :func:`cell_status`), and how many
    systems and record rows they hold (a cell has one row per system and repeat)."""
    columns = ["spec", "cells", *STATUSES, "systems", "rows"]
    if df.empty:
        return pd.DataFrame(columns=columns)
    rows = []
    for spec, g in df.groupby("spec", sort=True):
        # a capacity-frontier search is one cell although each of its probe rows has its own id
        ids = g["search_id"].fillna(g["cell_id"]) if "search_id" in g.columns else g["cell_id"]
        statuses = [cell_status(rows_of_cell) for _, rows_of_cell in g.groupby(ids, sort=False)]
        row = {"spec": spec, "cells": len(statuses)}
        for s in STATUSES:
            row[s] = statuses.count(s)
        row["systems"], row["rows"] = int(g["system"].nunique()), len(g)
        rows.append(row)
    return pd.DataFrame(rows, columns=columns)
