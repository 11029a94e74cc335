"""Job files: what a worker process runs (a cell as JSON) and where it writes its record."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from harness.spec.cell import Cell

__all__ = ["read_job", "write_job"]


def write_job(path: Path, cell: Cell, record_path: Path) -> Path:
    """Write a job file atomically (temp + rename) for ``python -m harness.execute.worker``. The record path is made
    absolute here: the worker runs in the repository root, not in the directory ``--out`` was given from."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    record = str(Path(record_path).absolute())
    tmp.write_text(json.dumps({"cell": cell.model_dump(mode="json"), "record_path": record}))
    os.replace(tmp, path)
    return path


def read_job(path: str | Path) -> tuple[Cell, Path]:
    data: dict[str, Any] = json.loads(Path(path).read_text())
    return Cell.model_validate(data["cell"]), Path(data["record_path"])
