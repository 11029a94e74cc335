"""``python -m harness.estimate.worker JOB.json``: estimate one cell (``harness.estimate.cell``) and write its
record file, as ``harness.execute.worker`` runs one."""

from __future__ import annotations

from pathlib import Path

from harness.execute.worker import main as worker_main
from harness.spec.cell import Cell

__all__ = ["estimate_here"]


def estimate_here(cell: Cell, folder: Path | None = None):
    """The records of ``cell`` estimated in this process (the job's folder is not needed)."""
    from harness.estimate.cell import estimate_cell

    return estimate_cell(cell, folder)


if __name__ == "__main__":
    raise SystemExit(worker_main(runner=estimate_here, module="harness.estimate.worker"))
