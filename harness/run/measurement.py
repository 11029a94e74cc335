"""A measurement cell (not an alignment or capacity-frontier cell) in this process or on this rank: which
loop measures it. Starts no process: a multi-rank cell's ranks are started by ``harness.execute``."""

from __future__ import annotations

import traceback
from typing import Any

from harness.run.columns import failed_records
from harness.run.memory import MemoryRefusal, preflight_cell
from harness.run.parallel_step import run_parallel_step_cell
from harness.run.setup import resolve_device
from harness.run.single_group import run_single_group_cell
from harness.spec.cell import Cell

__all__ = ["measure_cell", "refusal"]


def refusal(cell: Cell, check_memory: bool = True) -> list[dict[str, Any]] | None:
    """Failure records for a cell that cannot be measured here (no such device, a layout the library does not
    support, a model it cannot build, sequences beyond the model's positions: ``error``; more memory than this
    process may take: ``refused``, see ``harness.run.memory``), before any model is built or rank started; None when it can."""
    try:
        device = resolve_device(cell.device)
    except RuntimeError:
        return failed_records(cell, "error", traceback.format_exc())
    if check_memory:
        try:
            preflight_cell(cell)
        except MemoryRefusal as e:
            return failed_records(cell, "refused", str(e), str(device))
        except ValueError as e:  # a model it cannot build, sequences beyond its positions
            return failed_records(cell, "error", str(e), str(device))
    if cell.parallel != type(cell.parallel)():
        from prefixflow.parallel import ParallelDims, check_supported

        try:
            check_supported(ParallelDims.of(cell.parallel.model_dump()))
        except ValueError as e:
            return failed_records(cell, "error", str(e), str(device))
    return None


def measure_cell(cell: Cell, memory_only: bool = False) -> list[dict[str, Any]] | None:
    """``cell``'s records: one group per step in one process (``single_group``), else the data-parallel step
    on this rank (``parallel_step``: rank 0 returns the merged records, the other ranks None)."""
    refused = refusal(cell, check_memory=not memory_only)  # a capacity probe's over-budget is its answer
    if refused is not None:
        return refused
    if cell.tree is not None:
        from harness.run.tree_cell import run_tree_cell

        return run_tree_cell(cell)
    if cell.world_size != 1 or cell.groups_per_step != 1:
        return run_parallel_step_cell(cell, memory_only=memory_only)
    return run_single_group_cell(cell, memory_only=memory_only)
