"""A cell of one rollout group per step in one process: its :class:`~harness.run.loop.Bench` (a model copy per
system, the cell's seeded group, a memory budget measured first where the cell asks for one) and its
records' columns. The loop itself is :func:`harness.run.loop.run_systems`."""

from __future__ import annotations

import math
import traceback
from typing import Any

import torch

from harness.run.columns import (
    base_record,
    cost_columns,
    counted_columns,
    failed_records,
    model_columns,
    model_shape,
    offload_columns,
    vision_columns,
)
from harness.run.loop import SystemRun, cell_records, run_systems
from harness.run.setup import build_for, make_group, resolve_device, vision_group, vocab_size_of, with_routing
from harness.spec.cell import Cell

__all__ = ["run_single_group_cell"]


class GroupBench:
    """One group per step; FLOPs counted; ``memory_budget: peak:SYSTEM`` measured before anything is timed."""

    count_flops = True

    def __init__(self, cell: Cell, device) -> None:
        self.cell, self.device = cell, device
        self.columns: dict[str, dict[str, Any]] = {}
        self.shapes: dict[str, Any] = {}
        self.budget: int | None = None

    def fresh(self, name: str):
        contender, model = build_for(name, self.cell, self.device)
        self.columns[name] = model_columns(model, self.cell, name)
        self.shapes[name] = model_shape(model, self.cell)
        return contender, model

    def parallelized(self, name: str, contender, model):
        return contender, model  # one rank: no layout

    def inputs(self, runs: list[SystemRun]) -> list:
        first = runs[0]
        if self.cell.vision is not None:
            return [vision_group(self.cell, first.model)]
        vocab = self.columns[first.name].get("vocab_size") or vocab_size_of(first.model)
        return [with_routing(make_group(self.cell, vocab), first.model)]

    def prepare(self, runs: list[SystemRun], step) -> None:
        from harness.spec.cell import PEAK_OF

        budget = self.cell.memory_budget
        if budget is None:
            return
        if isinstance(budget, str):  # peak:SYSTEM: that system's peak in one metered step
            peer = next((r for r in runs if r.name == PEAK_OF.fullmatch(budget).group(1)), None)
            results = None if peer is None else step(peer, True)
            if not results:
                return
            budget = int(results["peak_mem_bytes"])
        self.budget = budget
        _set_budget([r.model for r in runs], budget)

    def inspect(self, run: SystemRun, last: bool) -> dict[str, Any]:
        return {}


def _set_budget(models: list, budget: int) -> None:
    """Hand ``budget`` to every PrefixFlow-wrapped model of the cell (``microbatch="auto"`` reads it)."""
    from dataclasses import replace

    from prefixflow import apply_prefixflow
    from prefixflow.runtime import runtime_of

    for model in models:
        runtime = runtime_of(model, create=True)
        if runtime is not None and runtime.config is not None:
            apply_prefixflow(model, replace(runtime.config, memory_budget_bytes=budget))


def _record(
    cell: Cell, device, bench: GroupBench, run: SystemRun, group, memory_only: bool
) -> dict[str, Any]:
    stats = run.stats[-1] if run.stats else None
    rec = {**base_record(cell, str(device)), "system": run.name, **bench.columns.get(run.name, {})}
    rec["tokens"] = cell.n * cell.prefix_len + (
        sum(len(r) for r in group.responses) if group is not None else cell.n * cell.suffix_len
    )
    rec["threads"] = torch.get_num_threads()
    rec["attention"] = getattr(run.contender, "attention_variant", lambda d: None)(device)
    if group is not None and run.name in bench.shapes:
        shape = bench.shapes[run.name]
        rec.update(cost_columns(shape, cell, run.contender, group.response_lens, device, stats))
    rec.update(counted_columns(run.counted))
    if cell.vision is not None:
        rec.update(
            vision_columns(
                cell,
                group,
                stats,
                shape=bench.shapes.get(run.name),
                system=getattr(run.contender, "cost_model", run.name),
            )
        )
    if cell.memory_budget is not None:
        rec["memory_budget_bytes"] = bench.budget
        plan = getattr(stats, "plan", None)
        if plan:
            rec["microbatch_sizes"] = ",".join(map(str, plan["microbatch_sizes"]))
            rec["auto_resident_bytes"] = plan["resident_bytes"]
            rec["auto_per_token_bytes"] = plan["per_token_bytes"]
    rec.update(offload_columns(cell, run.name, run.contender, getattr(stats, "offload", None)))
    if run.failure is not None:
        rec["status"], rec["error"] = run.failure
        return rec
    rec.update(status="ok", error=None, samples=run.samples, memory=run.memory)
    rec.update(
        loss=float(stats.loss),
        n_microbatches=stats.n_microbatches,
        prefix_tokens=stats.prefix_tokens,
        suffix_tokens=stats.suffix_tokens,
        trunk_tokens=getattr(stats, "trunk_tokens", None),
    )
    if cell.warmup > 0 and not memory_only:
        rec["first_step_s"] = run.first_step_s
    return rec


def run_single_group_cell(cell: Cell, memory_only: bool = False, runner=None) -> list[dict[str, Any]]:
    """Every system of ``cell`` on one group, interleaved; one record per system, never raises for a failing
    one (status error/oom with the traceback). ``memory_only``: see :func:`harness.run.loop.run_systems`;
    ``runner``: the loop (an estimate's runs the same cell on fake tensors)."""
    try:
        device = resolve_device(cell.device)
    except RuntimeError:
        return failed_records(cell, "error", traceback.format_exc())
    bench = GroupBench(cell, device)
    if runner is None:
        runs, inputs = run_systems(cell, device, bench, memory_only=memory_only)
    else:
        runs, inputs = runner(cell, device, bench, memory_only=memory_only)
    group = inputs[0] if inputs else None
    records = cell_records(
        cell, [[_record(cell, device, bench, run, group, memory_only) for run in runs]], False
    )
    for rec in records:
        if "first_step_s" in rec:
            rec["compile_time_s"] = rec["first_step_s"] - rec["step_time_s"] if cell.compile else math.nan
    return records
