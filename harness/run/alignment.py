"""An alignment cell (Table 3): PrefixFlow's gradients, losses and weights against the baseline's, in the
cell's layout, and the rows those records hold once collected."""

from __future__ import annotations

import traceback
from typing import Any

import torch.distributed as dist

from harness.run.columns import base_record, classify, failed_records
from harness.run.setup import resolve_device
from harness.spec.cell import Cell, report_steps_for
from prefixflow.memory.limit import MemoryRefusal

__all__ = ["ALIGNMENT_KEYS", "alignment_rows", "run_alignment_cell"]


def run_alignment_cell(cell: Cell) -> list[dict[str, Any]] | None:
    """An alignment cell: Table 3 rows (one record per run, step and quantity) of PrefixFlow vs the baseline
    in the cell's layout, on this rank (of a multi-rank cell: rank 0 returns the rows, the others None)."""
    from prefixflow.model.dtypes import DTYPES

    settings = cell.alignment
    kwargs = dict(
        overrides=dict(cell.model.overrides),
        dtype=DTYPES[cell.dtype],
        steps=settings.steps,
        report_steps=report_steps_for(settings.steps),
        prefix_len=cell.prefix_len,
        suffix_len=cell.suffix_len,
        n=cell.n,
        layout=cell.layout,
        microbatch=cell.microbatch,
        loss=cell.loss,
        ac=cell.ac,
        lr=settings.lr,
        seed=cell.seed,
    )
    try:
        if cell.parallel == type(cell.parallel)() and cell.groups in (None, 1):
            from prefixflow.checks.alignment import run_alignment

            rows = run_alignment(cell.model.name, device=resolve_device(cell.device), **kwargs)
        else:
            from prefixflow.parallel import init_distributed
            from prefixflow.parallel.align import run_parallel_alignment

            if cell.world_size > 1:
                init_distributed(resolve_device(cell.device))
            rows = run_parallel_alignment(
                cell.model.name,
                dims=cell.parallel.model_dump(),
                groups_per_step=cell.groups,
                split_threshold=cell.split_threshold,
                **kwargs,
            )
    except MemoryRefusal as e:  # its copies cannot fit: refused before any was built
        return failed_records(cell, "refused", str(e))
    except Exception as e:
        return failed_records(cell, classify(e), traceback.format_exc())
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    base = base_record(cell)
    return [{**base, **r.as_dict(), "system": r.run, "status": "ok", "error": None} for r in rows]


ALIGNMENT_KEYS = ("model", "layout", "microbatch", "ac", "parallel")


def alignment_rows(records) -> tuple[Any, Any]:
    """Split collected records into (measurement records, Table 3 rows). The rows take the shape
    ``pf-bench align --out`` writes, with the parallel layout (``single`` for one process) as a row key."""
    import pandas as pd

    if "quantity" not in records.columns:
        return records, pd.DataFrame()
    is_row = records["quantity"].isin(("G", "L", "W"))  # not the simulator's validation rows (phase_b_s ...)
    rows = records[is_row].copy()
    if rows.empty:
        return records[~is_row], pd.DataFrame()
    rows["parallel"] = rows["parallel_layout"].fillna("single") if "parallel_layout" in rows else "single"
    rows["step"] = rows["step"].astype(int)
    rows["microbatch"] = rows["microbatch"].map(lambda m: "all" if m is None or m != m else str(int(m)))
    keep = [
        *ALIGNMENT_KEYS,
        "dtype",
        "run",
        "step",
        "quantity",
        "max_abs_diff",
        "max_abs_value",
        "passed",
        "norm_rel_diff",
        "norm_tol",
        "worst_tensor",
        "tau_abs",
        "tau_rel",
        "paper_pass",
        "margin",
        "git_rev",
    ]
    return records[~is_row], rows[[c for c in keep if c in rows.columns]].reset_index(drop=True)
