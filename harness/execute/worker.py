"""``python -m harness.execute.worker JOB.json``: run one cell and write its record file atomically.

JOB.json (``harness.execute.jobs``) holds the cell and its record path. The record is always written,
whatever the cell does (status ok/error/oom); only a hard kill leaves it to the executor.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

from harness.execute.jobs import read_job
from harness.records import cell_status, write_records
from harness.spec.cell import Cell

THREADS_ENV = "PF_BENCH_THREADS"


def _set_threads() -> None:
    value = os.environ.get(THREADS_ENV) or os.environ.get("SLURM_CPUS_PER_TASK")
    if value and value.isdigit() and int(value) > 0:
        import torch

        torch.set_num_threads(int(value))


def run_job(cell: Cell, record_path: Path, runner=None) -> str:
    """Run ``cell`` (here, or on its local ranks when this process is not one of them) and write its records;
    returns the cell's status. ``runner(cell, folder)``: what gives the records (default: run the cell;
    an estimate's worker estimates it)."""
    from harness.execute.local import run_cell
    from harness.run.columns import failed_records

    _set_threads()
    try:
        records = (runner or run_cell)(cell, record_path.parent)
    except Exception:
        records = failed_records(cell, "error", traceback.format_exc())
    if records is None:  # a rank other than 0 of a multi-rank cell: rank 0 writes the record
        return "ok"
    write_records(record_path, records, root=record_path.parent.parent)  # no link below the results folder
    import pandas as pd

    return cell_status(pd.DataFrame(records))


def main(argv: list[str] | None = None, runner=None, module: str = "harness.execute.worker") -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(f"usage: python -m {module} JOB.json", file=sys.stderr)
        return 2
    cell, record_path = read_job(argv[0])
    status = run_job(cell, record_path, runner)
    _close_process_group()
    print(f"cell {cell.cell_id}: {status}")
    return 0


def _close_process_group() -> None:
    """End a multi-rank cell's process group before the interpreter exits: gloo aborts the process
    ("terminate called without an active exception") when a group is torn down at exit instead."""
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
