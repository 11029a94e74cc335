"""One cell in this process or on this rank -> its records, by kind: a capacity-frontier search, an
alignment cell (Table 3) or a measurement. Starts no process (``harness.execute`` does)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.run.alignment import run_alignment_cell
from harness.run.frontier import run_frontier
from harness.run.measurement import measure_cell
from harness.spec.cell import Cell

__all__ = ["run_cell"]


def run_cell(cell: Cell, folder: str | Path | None = None) -> list[dict[str, Any]] | None:
    """The cell's records (None on a rank other than 0 of a multi-rank cell). ``folder``: the spec folder its
    record goes to (a frontier search keeps its probes under it: it needs one)."""
    if cell.frontier is not None:
        if folder is None:
            raise ValueError("a capacity-frontier cell needs the folder its probes are kept in")
        return run_frontier(cell, folder)
    if cell.alignment is not None:
        return run_alignment_cell(cell)
    return measure_cell(cell)
