"""One cell estimated: the cell kinds of one rank (a rollout group, a tree) through their own record code
(``harness.run.single_group``, ``harness.run.tree_cell``) with the estimate's loop; other kinds refused in one
line."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from harness.estimate.fake import FAKE_METER, RealTensorError
from harness.estimate.loop import estimate_systems
from harness.run.columns import failed_records
from harness.run.frontier import run_frontier
from harness.run.measurement import refusal
from harness.run.memory import check_cell_sequences
from harness.spec.cell import Cell

__all__ = ["estimate_cell", "unsupported", "RealTensorError", "FAKE_METER"]


def unsupported(cell: Cell) -> str | None:
    """Why ``cell`` is no kind an estimate runs yet (one line naming the cell and the field), or None."""
    why = None
    if cell.alignment is not None:
        why = "an alignment cell (its losses need values)"
    elif cell.compile:
        why = "compile: torch.compile cannot run under the fake tensors' dispatch mode; drop compile"
    elif cell.tree is not None and cell.world_size != 1:
        why = f"a tree on a layout of {cell.world_size} ranks; estimates run trees on one rank"
    return None if why is None else f"cell {cell.cell_id}: cannot be estimated: {why}"


def _finite_or_none(rec: dict[str, Any]) -> dict[str, Any]:
    """An estimate's ok row has no times and no loss (fake tensors have no values): empty, not NaN."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}


def estimate_cell(cell: Cell, folder: str | Path | None = None) -> list[dict[str, Any]]:
    """``cell``'s records with ``mem_meter = "fake-live-bytes"``: per system the peak live bytes of each
    phase and the counted FLOPs, from the cell's own step on fake tensors; ``estimate_s`` is the metered
    step's wall time. Never raises for a failing system (``refused``: one line naming the op and the cell).
    A capacity-frontier cell is searched with estimated probes (``harness.run.frontier``; each probe's rows
    are kept under ``folder``, the spec folder)."""
    if cell.frontier is not None:
        if folder is None:
            return failed_records(cell, "error", "a capacity-frontier search needs the folder its probes go to")
        return run_frontier(cell, folder, probe=estimate_cell, estimate=True)
    why = unsupported(cell)
    if why is not None:
        return failed_records(cell, "refused", why, "cpu")
    refused = refusal(cell, check_memory=False)  # the device, the layout, the model
    if refused is not None:
        return refused
    try:  # the sequences against the model's positions (the memory floor is what the estimate finds)
        check_cell_sequences([cell])
    except ValueError as e:
        return failed_records(cell, "error", str(e), "cpu")
    ran: dict[str, Any] = {}

    def runner(*args, **kwargs):
        runs, inputs = estimate_systems(*args, **kwargs)
        ran.update((r.name, r) for r in runs)
        return runs, inputs

    if cell.tree is not None:
        from harness.run.tree_cell import run_tree_cell

        records = run_tree_cell(cell, runner=runner)
    elif cell.world_size != 1 or cell.groups_per_step != 1:
        from harness.estimate.world import estimate_layout

        records = estimate_layout(cell)
    else:
        from harness.run.single_group import run_single_group_cell

        records = run_single_group_cell(cell, runner=runner)
    out = []
    for rec in records:
        run = ran.get(rec["system"])
        if run is not None and run.memory is not None:
            rec["estimate_s"] = run.memory.get("estimate_s")
            for key in ("modelled_time_s", "modelled_bytes"):  # the FLOP-counting step's ops on the H20
                rec[key] = run.memory.get(key, math.nan)
        if rec.get("status") == "ok":
            rec["mem_meter"] = FAKE_METER
        out.append(_finite_or_none(rec))
    return out
