"""A cell's files: where its job and record go, whether a record can stand for the cell, and the status rows
an executor writes for a cell whose worker left none (every executor shares these)."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from harness.records import InvalidRecord, cell_status, read_records, write_records
from harness.run.columns import failed_records
from harness.safe_fs import jobs_folder
from harness.spec.cell import Cell

__all__ = ["OnDone", "check_record", "finish", "job_path", "record_path", "recorded_status", "tail"]

OnDone = Callable[[Cell, str], None]


def record_path(folder: Path, cell: Cell) -> Path:
    return folder / f"{cell.cell_id}.parquet"


def job_path(folder: Path, cell: Cell) -> Path:
    """The cell's job file, in the spec folder's private job folder (never in the results folder: a job
    file says what to run and where to write)."""
    return jobs_folder(folder) / f"{cell.cell_id}.json"


def check_record(path: Path, cell: Cell | None = None) -> str | None:
    """Why the record file at ``path`` cannot stand for ``cell`` (None: it can). A missing file is a reason.
    Verifies the file (harness.records.read_records) and that it holds this cell's spec and systems."""
    if not os.path.lexists(path):
        return "no record"
    try:
        df = read_records(path)
    except InvalidRecord as e:
        return str(e)
    if cell is not None:
        if set(df["spec"]) != {cell.spec}:
            return f"{path}: holds spec {sorted(set(df['spec']))[0]!r:.60}, not {cell.spec!r}"
        if not set(df["system"]) <= set(cell.systems):
            return f"{path}: holds systems {sorted(set(df['system']))!r:.80}, not the cell's {list(cell.systems)}"
    return None


def recorded_status(path: Path, cell: Cell | None = None) -> str | None:
    """The status of an existing record file that passes :func:`check_record`, else None."""
    if check_record(path, cell) is not None:
        return None
    return cell_status(read_records(path))


def tail(path: Path, limit: int = 4000) -> str:
    """The last ``limit`` bytes of a log file (never through a link, never more than that read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        fh.seek(max(0, os.fstat(fd).st_size - limit))
        return fh.read(limit).decode(errors="replace")


def finish(cell: Cell, rpath: Path, status: str, error: str) -> str:
    """Write status rows for a cell whose worker left no record; keep a record the worker did write."""
    existing = recorded_status(rpath, cell)
    if existing is not None:
        return existing
    write_records(rpath, failed_records(cell, status, error), root=rpath.parent.parent)
    return status
