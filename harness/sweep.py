"""A sweep over a results folder: plan (which cells are missing), run (locked, resumable), status."""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from harness.executors import record_path, recorded_status
from harness.records import STATUSES, collect, summarize
from harness.spec import Cell, Spec, expand, safe_name

MANIFEST = "_manifest.json"
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


def plan(spec: Spec, out: str | Path, retry_failed: bool = False) -> Plan:
    """Which cells of ``spec`` already have a readable record (skipped) and which must run."""
    folder = spec_folder(out, spec.name)
    p = Plan(folder=folder, cells=expand(spec))
    for cell in p.cells:
        status = recorded_status(record_path(folder, cell))
        if status is None or (retry_failed and status != "ok"):
            p.todo.append(cell)
        else:
            p.done[cell.cell_id] = status
    return p


@contextmanager
def sweep_lock(folder: Path) -> Iterator[None]:
    """One sweep per folder at a time (flock; released by the kernel if the sweep is killed)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "_sweep.lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(
                f"another sweep is running on {folder}; wait for it or use another --out"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _clean_stale_temps(folder: Path) -> int:
    """Remove temp files left by killed writers (older than STALE_TMP_S, so live writes are safe)."""
    removed = 0
    for tmp in folder.glob(".*.tmp"):
        if time.time() - tmp.stat().st_mtime > STALE_TMP_S:
            tmp.unlink(missing_ok=True)
            removed += 1
    return removed


def write_manifest(spec: Spec, p: Plan) -> Path:
    path = p.folder / MANIFEST
    data = {"spec": spec.name, "cells": [c.cell_id for c in p.cells]}
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    return path


def run_sweep(
    spec: Spec,
    out: str | Path,
    executor,
    retry_failed: bool = False,
    on_start: Callable[[Plan], None] | None = None,
    on_done: Callable[[Cell, str], None] | None = None,
) -> Plan:
    """Run every missing cell of ``spec`` into ``OUT/<spec>/`` with ``executor``; returns the plan."""
    folder = spec_folder(out, spec.name)
    with sweep_lock(folder):
        _clean_stale_temps(folder)
        p = plan(spec, out, retry_failed)
        write_manifest(spec, p)
        if on_start is not None:
            on_start(p)

        def done(cell: Cell, status: str) -> None:
            p.done[cell.cell_id] = status
            if on_done is not None:
                on_done(cell, status)

        executor.run(p.todo, folder, done)
    return p


def status_table(root: str | Path) -> pd.DataFrame:
    """Per spec under ``root``: cells recorded, rows by status, and (from manifests) expected and missing."""
    root = Path(root)
    recorded = {r["spec"]: r for r in summarize(collect(root)).to_dict("records")}
    expected: dict[str, tuple[int, int]] = {}
    for manifest in sorted(root.rglob(MANIFEST)):
        data = json.loads(manifest.read_text())
        have = sum(recorded_status(manifest.parent / f"{c}.parquet") is not None for c in data["cells"])
        expected[data["spec"]] = (len(data["cells"]), len(data["cells"]) - have)
    columns = ["spec", "cells", *STATUSES, "expected", "missing"]
    rows = []
    for spec in sorted(set(recorded) | set(expected)):
        row = {"spec": spec, "cells": 0, **dict.fromkeys(STATUSES, 0), **recorded.get(spec, {})}
        row["expected"], row["missing"] = expected.get(spec, (None, None))
        rows.append(row)
    return pd.DataFrame(rows, columns=columns)
