"""A cell of one group per step in one process: a model copy per contender, warm-up, interleaved repeats,
measurements, records."""

from __future__ import annotations

import gc
import math
import traceback
from typing import Any

import torch

from harness.run.columns import (
    base_record,
    classify,
    cost_columns,
    counted_columns,
    failed_records,
    memory_columns,
    model_columns,
    model_shape,
    offload_columns,
    step_time_columns,
)
from harness.run.measure import PhaseMeter, rank_max
from harness.run.progress import report
from harness.run.setup import (
    build_for,
    make_group,
    resolve_device,
    vocab_size_of,
    with_routing,
)
from harness.spec.cell import Cell

__all__ = ["run_single_group_cell"]


def _release(model: torch.nn.Module | None, device: torch.device) -> None:
    if model is not None:
        model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_single_group_cell(cell: Cell, memory_only: bool = False) -> list[dict[str, Any]]:
    """Run every contender of ``cell`` interleaved (A B A B ...); one record per contender, never raises for
    a failing one (status error/oom with the traceback). ``memory_only`` (capacity probes): on CPU one
    step per contender with the live-bytes meter and no timed steps; on CUDA one step and no warm-up."""
    try:
        device = resolve_device(cell.device)
    except RuntimeError:
        return failed_records(cell, "error", traceback.format_exc())
    contenders, models, failures, extras, shapes = {}, {}, {}, {}, {}
    for name in cell.systems:
        report(f"building {name} ({cell.model.display}, {cell.dtype}, {device})")
        try:
            contenders[name], models[name] = build_for(name, cell, device)
            extras[name] = model_columns(models[name], cell, name)
            shapes[name] = model_shape(models[name], cell)
        except Exception as e:
            failures[name] = (classify(e), traceback.format_exc())
    group = None
    if models:
        try:
            vocab = extras[next(iter(models))].get("vocab_size") or vocab_size_of(next(iter(models.values())))
            group = with_routing(make_group(cell, vocab), next(iter(models.values())))
        except Exception as e:
            for name in models:
                failures[name] = (classify(e), traceback.format_exc())

    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in cell.systems}
    last_stats: dict[str, Any] = {}
    first_step: dict[str, float] = {}

    counted: dict[str, Any] = {}

    def measured_step(
        name: str, track_memory: bool, count: bool = False
    ) -> tuple[dict[str, Any], Any] | None:
        """One step; ``count``: under the FLOP counters too (harness.costmodel.flops.count_flops), untimed."""
        from harness.costmodel.flops import count_flops

        model = models[name]
        try:
            model.zero_grad(set_to_none=True)
            meter = PhaseMeter(device, model=model, track_memory=track_memory)
            with meter:
                if count:
                    counted[name], stats = count_flops(
                        lambda: contenders[name].step(model, [group], cell, meter)
                    )
                else:
                    stats = contenders[name].step(model, [group], cell, meter)
            res = rank_max(meter.results(extended=True))
            model.zero_grad(set_to_none=True)
            return res, stats
        except Exception as e:
            failures[name] = (classify(e), traceback.format_exc())
            models[name] = None
            _release(model, device)
            return None

    budget = None
    if group is not None and cell.memory_budget is not None:
        budget = _resolve_budget(cell, measured_step, models, failures)
        if budget is not None:
            _set_budget(models, budget)

    # Timed steps, interleaved A B A B ...; on CPU without the per-op live-bytes meter (its overhead would
    # distort times, and torch.compile cannot run under a dispatch mode). CUDA memory stats are free.
    on_cpu = device.type == "cpu"
    warmup = 0 if memory_only else cell.warmup
    steps = (0 if on_cpu else 1) if memory_only else cell.warmup + cell.repeats
    for it in range(steps):
        for name in cell.systems:
            if name not in failures:
                phase = (
                    f"warm-up {it + 1}/{warmup}"
                    if it < warmup
                    else f"repeat {it - warmup + 1}/{steps - warmup}"
                )
                report(f"{phase} {name}")
            if name in failures or (out := measured_step(name, track_memory=False)) is None:
                continue
            if it == 0:
                first_step[name] = out[0]["step_time_s"]
            if it >= warmup:
                samples[name].append(out[0])
                last_stats[name] = out[1]
    # On CPU, one extra (untimed) step per system with the live-bytes meter gives peak memory per phase; it
    # also counts the FLOPs that ran (not for capacity probes). On CUDA, counting takes a step of its own.
    memory: dict[str, dict[str, Any]] = {}
    count = not memory_only and not cell.compile
    if on_cpu and not cell.compile:
        for name in cell.systems:
            if name not in failures:
                report(f"memory and FLOPs step {name} (untimed)")
            if name not in failures and (out := measured_step(name, True, count)) is not None:
                memory[name] = out[0]
                if memory_only:  # the probe's only step: its times were taken under the meter
                    samples[name], last_stats[name] = [out[0]], out[1]
    elif count:
        for name in cell.systems:
            if name not in failures:
                measured_step(name, track_memory=False, count=True)

    tokens = cell.n * cell.prefix_len + (
        sum(len(r) for r in group.responses) if group else cell.n * cell.suffix_len
    )
    records = []
    for name in cell.systems:
        rec = {**base_record(cell, str(device)), "system": name, "tokens": tokens, **extras.get(name, {})}
        rec["threads"] = torch.get_num_threads()
        contender = contenders.get(name)
        rec["attention"] = getattr(contender, "attention_variant", lambda d: None)(device)
        if group is not None and name in shapes:
            rec.update(
                cost_columns(shapes[name], cell, contender, group.response_lens, device, last_stats.get(name))
            )
        rec.update(counted_columns(counted.get(name)))
        if cell.memory_budget is not None:
            rec["memory_budget_bytes"] = budget
            plan = getattr(last_stats.get(name), "plan", None)
            if plan:
                rec["microbatch_sizes"] = ",".join(map(str, plan["microbatch_sizes"]))
                rec["auto_resident_bytes"] = plan["resident_bytes"]
                rec["auto_per_token_bytes"] = plan["per_token_bytes"]
        rec.update(offload_columns(cell, name, contenders.get(name), last_stats.get(name)))
        if name in failures:
            rec["status"], rec["error"] = failures[name]
        else:
            rec.update(status="ok", error=None, **step_time_columns(samples[name]))
            rec.update(memory_columns(memory.get(name), samples[name], cell))
            st = last_stats[name]
            rec.update(
                loss=float(st.loss),
                n_microbatches=st.n_microbatches,
                prefix_tokens=st.prefix_tokens,
                suffix_tokens=st.suffix_tokens,
                trunk_tokens=getattr(st, "trunk_tokens", None),
            )
            if warmup > 0:
                rec["first_step_s"] = first_step[name]
                rec["compile_time_s"] = first_step[name] - rec["step_time_s"] if cell.compile else math.nan
        records.append(rec)
    return records


def _resolve_budget(cell: Cell, measured_step, models, failures) -> int | None:
    """The cell's memory budget in bytes: given, or ``peak:SYSTEM``: that system's peak in one metered step
    (CPU: the live-bytes meter; CUDA: ``max_memory_allocated``), measured before anything is timed."""
    from harness.spec.cell import PEAK_OF

    if isinstance(cell.memory_budget, int):
        return cell.memory_budget
    peer = PEAK_OF.fullmatch(cell.memory_budget).group(1)
    if peer in failures or models.get(peer) is None:
        return None
    out = measured_step(peer, track_memory=True)
    return None if out is None else int(out[0]["peak_mem_bytes"])


def _set_budget(models: dict, budget: int) -> None:
    """Hand ``budget`` to every PrefixFlow-wrapped model of the cell (``microbatch="auto"`` reads it)."""
    from dataclasses import replace

    from prefixflow import apply_prefixflow
    from prefixflow.runtime import runtime_of

    for model in models.values():
        runtime = None if model is None else runtime_of(model, create=True)
        if runtime is not None and runtime.config is not None:
            apply_prefixflow(model, replace(runtime.config, memory_budget_bytes=budget))
