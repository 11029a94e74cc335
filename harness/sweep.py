"""A sweep over a results folder: plan (which cells are missing), run (locked, resumable), status."""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from harness.execute.executors import check_record, record_path, recorded_status
from harness.records import ESTIMATE_METER, STATUSES, collect, read_records, summarize
from harness.safe_fs import atomic_write, open_dir, open_lock
from harness.spec.cell import Cell
from harness.spec.load import DEFAULT_MAX_CELLS, expand, safe_name
from harness.spec.schema import Spec

MANIFEST = "_manifest.json"
MANIFEST_MAX_BYTES = 16 * 2**20
CELL_ID = re.compile(r"^[0-9a-f]{12}$")
STALE_TMP_S = 60.0


def spec_folder(out: str | Path, spec_name: str) -> Path:
    """``OUT/<safe spec name>``; the name is reduced to [A-Za-z0-9._-] so it stays inside OUT."""
    return Path(out) / safe_name(spec_name)


@dataclass
class Plan:
    folder: Path
    cells: list[Cell]
    done: dict[str, str] = field(default_factory=dict)  # cell_id -> recorded status
    todo: list[Cell] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)  # record files that failed verification (will rerun)

    @property
    def failed(self) -> dict[str, str]:
        """cell_id -> status of every cell whose recorded status is not ``ok``."""
        return {cid: status for cid, status in self.done.items() if status != "ok"}


def plan(
    spec: Spec,
    out: str | Path,
    retry_failed: bool = False,
    max_cells: int = DEFAULT_MAX_CELLS,
    estimate: bool = False,
) -> Plan:
    """Which cells of ``spec`` already have a verified record (skipped) and which must run. A record file
    that fails verification is named in ``Plan.invalid`` and its cell runs again. A measured sweep refuses a
    folder that holds estimated records (``estimate``: the other way round): a cell id does not say which."""
    folder = spec_folder(out, spec.name)
    p = Plan(folder=folder, cells=expand(spec, max_cells=max_cells))
    for cell in p.cells:
        rpath = record_path(folder, cell)
        problem = check_record(rpath, cell)
        status = None if problem is not None else recorded_status(rpath, cell)
        if problem is not None and os.path.lexists(rpath):
            p.invalid.append(problem)
        if status is None or (retry_failed and status != "ok"):
            p.todo.append(cell)
        else:
            _same_kind(read_records(rpath), estimate, folder, cell.cell_id)
            p.done[cell.cell_id] = status
    return p


def _same_kind(records, estimate: bool, folder: Path, cell_id: str) -> None:
    estimated = bool((records.get("mem_meter") == ESTIMATE_METER).any()) if "mem_meter" in records else False
    if estimated != estimate:
        have, want = ("estimated", "measured") if estimated else ("measured", "estimated")
        raise ValueError(
            f"{folder}: cell {cell_id} is recorded {have}; a {want} sweep needs its own --out folder "
            "(estimated and measured records of one cell share its id)"
        )


@contextmanager
def sweep_lock(folder: Path) -> Iterator[None]:
    """One sweep per folder at a time (flock; released by the kernel if the sweep is killed). The lock
    file is never truncated and never opened through a link."""
    fd = open_lock(folder / "_sweep.lock", root=folder.parent)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(
                f"another sweep is running on {folder}; wait for it or use another --out"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _clean_stale_temps(folder: Path) -> int:
    """Remove temp files left by killed writers (older than STALE_TMP_S, so live writes are safe)."""
    removed = 0
    with open_dir(folder, folder.parent) as dfd:
        for name in os.listdir(dfd):
            if not (name.startswith(".") and name.endswith(".tmp")):
                continue
            try:
                if time.time() - os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mtime > STALE_TMP_S:
                    os.unlink(name, dir_fd=dfd)
                    removed += 1
            except FileNotFoundError:
                pass
    return removed


def write_manifest(spec: Spec, p: Plan) -> Path:
    data = json.dumps({"spec": spec.name, "cells": [c.cell_id for c in p.cells]}, indent=1).encode()
    return atomic_write(p.folder / MANIFEST, lambda fh: fh.write(data), root=p.folder.parent)


def results_tree_of(path: str | Path) -> Path | None:
    """The results folder that ``path`` would land in (a folder above it holds a sweep's manifest or lock,
    or spec folders that do), else None."""
    real = Path(os.path.realpath(path))
    for folder in real.parents:
        if (folder / MANIFEST).exists() or (folder / "_sweep.lock").exists():
            return folder.parent
        if any((sub / MANIFEST).exists() for sub in _subdirs(folder)):
            return folder
    return None


def _subdirs(folder: Path, limit: int = 1000) -> list[Path]:
    try:
        with os.scandir(folder) as it:
            return [
                Path(e.path)
                for _, e in zip(range(limit), it, strict=False)
                if e.is_dir(follow_symlinks=False)
            ]
    except OSError:
        return []


def read_manifest(path: Path) -> tuple[str, list[str]]:
    """(spec name, cell ids) of a sweep manifest; ValueError naming the file if it is not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as fh:
            raw = fh.read(MANIFEST_MAX_BYTES + 1)
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror})") from None
    if len(raw) > MANIFEST_MAX_BYTES:
        raise ValueError(f"{path}: larger than {MANIFEST_MAX_BYTES} bytes")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ValueError(f"{path}: not valid JSON") from None
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("spec"), str)
        or not isinstance(data.get("cells"), list)
    ):
        raise ValueError(f"{path}: not a sweep manifest (needs 'spec' and 'cells')")
    if not all(isinstance(c, str) and CELL_ID.fullmatch(c) for c in data["cells"]):
        raise ValueError(f"{path}: 'cells' must be 12-hex-digit cell ids")
    return data["spec"], data["cells"]


def run_sweep(
    spec: Spec,
    out: str | Path,
    executor,
    retry_failed: bool = False,
    on_start: Callable[[Plan], None] | None = None,
    on_done: Callable[[Cell, str], None] | None = None,
    max_cells: int = DEFAULT_MAX_CELLS,
) -> Plan:
    """Run every missing cell of ``spec`` into ``OUT/<spec>/`` with ``executor``; returns the plan."""
    folder = spec_folder(out, spec.name)
    with open_dir(folder, Path(out)):  # created, and not a link planted in OUT
        pass
    with sweep_lock(folder):
        _clean_stale_temps(folder)
        p = plan(spec, out, retry_failed, max_cells, estimate=getattr(executor, "estimate", False))
        write_manifest(spec, p)
        if on_start is not None:
            on_start(p)

        def done(cell: Cell, status: str) -> None:
            p.done[cell.cell_id] = status
            if on_done is not None:
                on_done(cell, status)

        executor.run(p.todo, folder, done)
    return p


def status_table(root: str | Path, problems: list[str] | None = None) -> pd.DataFrame:
    """Per spec under ``root``: cells recorded, rows by status, and (from manifests) expected and missing.
    Record files and manifests that fail verification are skipped and named in ``problems``."""
    root = Path(root)
    problems = [] if problems is None else problems
    recorded = {r["spec"]: r for r in summarize(collect(root, problems=problems)).to_dict("records")}
    expected: dict[str, tuple[int, int]] = {}
    for manifest in sorted(root.rglob(MANIFEST)):
        try:
            spec, cells = read_manifest(manifest)
        except ValueError as e:
            problems.append(str(e))
            continue
        have = sum(recorded_status(manifest.parent / f"{c}.parquet") is not None for c in cells)
        expected[spec] = (len(cells), len(cells) - have)
    columns = ["spec", "cells", *STATUSES, "expected", "missing", "systems", "rows"]
    rows = []
    for spec in sorted(set(recorded) | set(expected)):
        row = {"spec": spec, "cells": 0, **dict.fromkeys(STATUSES, 0), "systems": 0, "rows": 0}
        row.update(recorded.get(spec, {}))
        row["expected"], row["missing"] = expected.get(spec, (None, None))
        rows.append(row)
    table = pd.DataFrame(rows, columns=columns)
    return table.astype({c: "Int64" for c in columns[1:]})  # whole numbers; a spec without manifest: <NA>
