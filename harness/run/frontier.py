"""Capacity frontier (paper §5.5, Claim 4.1): the largest sequence length that fits a memory budget.

A search cell (``Cell.frontier`` set; one per spec ``frontier:`` block x variant) grows one length:

- ``mode: ratio``: the total P+S at a fixed prefix ratio (P = round(ratio * total));
- ``mode: prefix``: the suffix S behind a fixed prefix P.

The search is bracketed: it probes ``min_len``, doubles until a probe does not fit (or ``max_len`` fits),
then bisects the bracket on a grid of ``resolution`` tokens until it is one step wide. Each probe is one
training step of a fresh model (``measure_cell(memory_only=True)``):

- on CUDA the device is the budget (``budget_bytes`` caps it through the allocator's memory fraction); an
  out-of-memory error is caught by the runner and recorded as ``oom``, and the search goes on;
- on CPU the live-bytes meter measures the step's peak (``peak_mem_bytes``, all phases), and a probe
  whose peak exceeds ``budget_bytes`` is recorded as ``oom`` with the measured peak.

Every probe becomes a record (columns ``probe``, ``budget_bytes``, ``fits``, ``searched_len``,
``frontier_mode``, ``frontier_ratio``, ``frontier_prefix``, ``search_id``, ``frontier_len``), and each is
kept under ``<spec folder>/_probes/<search id>/`` as soon as it is measured, so a search that is killed
resumes where it stopped. The search cell's record file holds every probe row.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from harness.records import read_records, write_records
from harness.run.columns import failed_records
from harness.run.measurement import measure_cell
from harness.run.setup import resolve_device
from harness.spec.cell import Cell, FrontierSearch

PROBES_DIR = "_probes"


def bracketed_search(min_len: int, max_len: int, resolution: int, fits: Callable[[int], bool | None]) -> int:
    """The largest length in ``[min_len, max_len]`` (on the grid ``min_len + k * resolution``, or
    ``max_len``) for which ``fits`` is true, assuming fitting is monotone; 0 when ``min_len`` does not fit.

    ``fits`` returning ``None`` (a probe that failed for another reason than memory) ends the search with
    the best length found so far.
    """
    if min_len < 1 or max_len < min_len or resolution < 1:
        raise ValueError(
            f"need 1 <= min_len <= max_len and resolution >= 1, got {min_len}, {max_len}, {resolution}"
        )

    def on_grid(length: int) -> int:
        return min(max_len, min_len + (length - min_len) // resolution * resolution)

    lo, hi = 0, None  # lo: largest length known to fit; hi: smallest known not to
    length = min_len
    while hi is None:  # bracket: double until a probe does not fit
        ok = fits(length)
        if ok is None:
            return lo
        if not ok:
            hi = length
        elif length >= max_len:
            return length
        else:
            lo = length
            nxt = on_grid(2 * length)
            length = nxt if nxt > length else max_len
    if lo == 0:
        return 0
    while hi - lo > resolution:  # bisect the bracket on the grid
        mid = on_grid(lo + (hi - lo) // 2)
        if mid <= lo:
            break
        ok = fits(mid)
        if ok is None:
            return lo
        lo, hi = (mid, hi) if ok else (lo, mid)
    return lo


def budget_of(search: FrontierSearch, device: torch.device | None) -> int:
    """The budget in bytes; on CUDA without one, the device's memory. ``device`` None: an estimate (fake
    tensors), which needs a budget as the CPU does."""
    if search.budget_bytes is not None:
        return int(search.budget_bytes)
    if device is not None and device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    where = "on CPU" if device is not None else "in an estimate"
    raise ValueError(
        f"a capacity-frontier search {where} needs frontier.budget_bytes (the live-bytes budget)"
    )


def refuse_ranks(cell: Cell) -> list[dict] | None:
    """A measured search runs on one rank: its probes decide on one peak. On several ranks it is refused
    (records naming the field and the fix); an estimate runs any layout (``harness.estimate``)."""
    if cell.frontier is None or cell.world_size == 1:
        return None
    why = (
        f"cell {cell.cell_id}: frontier.parallel: a measured capacity-frontier search runs on one rank, "
        f"this one on {cell.parallel.label} ({cell.world_size} ranks); estimate it (executor kind estimate, "
        f"or pf-bench sweep --estimate) or drop the layout"
    )
    return failed_records(cell, "refused", why)


def _probe_id(search_id: str, length: int) -> str:
    return hashlib.sha256(f"{search_id}:{length}".encode()).hexdigest()[:12]


def _judge(rec: dict[str, Any], budget: int) -> dict[str, Any]:
    """Mark a probe row: an ``ok`` step over the budget (CPU meter) becomes ``oom``; sets ``fits``."""
    peak = rec.get("peak_mem_bytes")
    over = rec["status"] == "ok" and peak is not None and not math.isnan(peak) and peak > budget
    if over:
        rec["status"] = "oom"
        rec["error"] = (
            f"peak {peak / 2**20:.2f} MiB ({rec.get('mem_meter')}) > budget {budget / 2**20:.2f} MiB"
        )
    rec["fits"] = rec["status"] == "ok"
    return rec


def run_frontier(
    cell: Cell, folder: str | Path, probe: Callable[[Cell], list[dict]] | None = None, estimate: bool = False
) -> list[dict]:
    """Run (or resume) the search of ``cell`` and return every probe's row. ``probe`` runs one probe cell
    (default: ``measure_cell(memory_only=True)``; an estimate passes its fake-tensor cell, with ``estimate``
    set so that no device is touched); tests pass a fake memory model."""
    search = cell.frontier
    if search is None:
        raise ValueError("run_frontier needs a cell with a frontier search")
    if not estimate and (refused := refuse_ranks(cell)) is not None:
        return refused
    probe = probe or (lambda c: measure_cell(c, memory_only=True))
    try:
        device = None if estimate else resolve_device(cell.device)
        budget = budget_of(search, device)
    except (RuntimeError, ValueError) as e:
        return failed_records(cell, "error", str(e))
    if device is not None and device.type == "cuda" and search.budget_bytes is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
    sid = cell.cell_id
    store = Path(folder) / PROBES_DIR / sid
    rows: list[dict[str, Any]] = []

    def fits(length: int) -> bool | None:
        prefix, suffix = search.split(length)
        path = store / f"{_probe_id(sid, length)}.parquet"
        try:
            recs = read_records(path).to_dict("records")  # measured before a restart
        except Exception:  # not measured yet (or a damaged file): measure
            pcell = cell.model_copy(update={"prefix_len": prefix, "suffix_len": suffix, "frontier": None})
            recs = [_judge(dict(r), budget) for r in probe(pcell)]
            for rec in recs:
                rec.update(
                    cell_id=_probe_id(sid, length),
                    search_id=sid,
                    budget_bytes=float(budget),
                    searched_len=length,
                    frontier_mode=search.mode,
                    frontier_ratio=search.ratio,
                    frontier_prefix=search.prefix_len,
                )
            if all(r["status"] in ("ok", "oom") for r in recs):  # an error is retried on resume, not kept
                write_records(path, recs, root=Path(folder).parent)
        for rec in recs:
            rec["probe"] = len(rows)
            rows.append(rec)
        if any(r["status"] not in ("ok", "oom") for r in recs):
            return None  # not a capacity answer (error): stop here, the row says why
        return all(bool(r["fits"]) for r in recs)

    best = bracketed_search(search.min_len, search.max_len, search.resolution, fits)
    for rec in rows:
        rec["frontier_len"] = best
    return rows
