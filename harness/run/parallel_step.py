"""A cell whose step is the data-parallel step (``prefixflow.parallel.train_step`` over the cell's groups),
on one rank or many: every rank measures its own steps; rank 0 merges them into the cell's records.

Runs in each rank of a local launch or a Slurm multi-task job (``harness.execute`` starts them), or in one
process for a single-rank cell with several groups per step. Each contender gets its own model copy, built
from the same seed and parallelized in TorchTitan's order (``prefixflow.parallel.parallelize``); a step is
the contender's ``step`` over the cell's groups (one per data-parallel rank unless the cell says
otherwise), contenders alternating A B A B as in the single-group loop.

The record's time of a step is the slowest rank's (the ranks meet at the gradient reduction); the cell's
``step_time_s`` is the median of those over the repeats. Each rank's own median is kept
(``step_time_s_per_rank``) with the spread ``(max - min) / max``. Peak memory is the max over ranks.
Columns from the step: the gradient-sync mode and its collective counts per step, and for split groups the
bytes exchanged next to the K/V and gK/gV sizes they must equal.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import traceback
from typing import Any

import torch
import torch.distributed as dist

from harness.contenders import get_contender
from harness.run.columns import (
    base_record,
    classify,
    cost_columns,
    failed_records,
    model_columns,
    model_shape,
)
from harness.run.measure import PhaseMeter
from harness.run.setup import build_cell_model, make_group, resolve_device
from harness.spec.cell import Cell

__all__ = ["run_parallel_step_cell", "merge_rank_samples", "median_step"]

TIMED = ("step_time_s", "phase_a_s", "phase_b_s", "phase_c_s")
MEMORY = ("peak_mem_bytes", "peak_mem_phase_b_bytes")


def _build(name: str, cell: Cell, device: torch.device, dims, mesh):
    from prefixflow.parallel import parallelize

    contender = get_contender(name)
    model = build_cell_model(cell, device)
    model = contender.prepare(model, cell)
    if dims.world_size > 1:  # a contender may turn a knob of the parallel schedule (e.g. CP prefetch off)
        options = getattr(contender, "parallel_options", {})
        model = parallelize(model, dims, ac=cell.ac, compile=cell.compile, mesh=mesh, **options)
    else:
        from prefixflow import apply_ac

        apply_ac(model, cell.ac)
        if cell.compile:
            from prefixflow.model.compile import apply_compile

            apply_compile(model)
    return model, contender


def _step_columns(stats) -> dict[str, Any]:
    ex, sync = stats.exchange, stats.grad_sync
    out = {
        "grad_sync": sync["mode"],
        "dp_all_reduces": sync.get("all_reduces", 0),
        "fsdp_units": sync.get("units"),
        "fsdp_reduce_scatters": sync.get("reduce_scatters"),
        "fsdp_reduce_scatters_per_unit": sync.get("max_reduce_scatters_per_unit"),
        "fsdp_all_gathers": sync.get("all_gathers"),
        "split_groups": len(stats.placement.split_groups),
        "split_kv_bytes": ex["kv_bytes"],
        "split_grad_kv_bytes": ex["grad_kv_bytes"],
        "split_expected_kv_bytes": ex["expected_kv_bytes"],
        "split_expected_grad_kv_bytes": ex["expected_grad_kv_bytes"],
        "split_exchange_exact": ex["kv_bytes"] == ex["expected_kv_bytes"]
        and ex["grad_kv_bytes"] == ex["expected_grad_kv_bytes"],
        "placement": json.dumps(stats.placement.as_dict()),
        "placement_imbalance": stats.placement.imbalance,
    }
    return out


_HOOK_MAX = ("pp_stage", "pp_span_s", "pp_bubble_s", "pp_bubble_mean_s", "pp_bubble_max_s",
             "cp_phase_b_rank_max_s", "cp_phase_b_spread_s")  # fmt: skip


def _timelines(model) -> str | None:
    """A pipeline stage's timelines of its last group, every stage's (JSON), or None."""
    from prefixflow.runtime import runtime_of

    pipeline = runtime_of(model, create=True).stage
    return json.dumps(pipeline.timelines) if pipeline is not None and pipeline.timelines else None


def _hook_columns(stats, timelines: str | None) -> dict[str, Any]:
    """The schedule hooks' counters of the step (``GroupStats.hooks``: CP gathers, bytes and communication
    times, PP bubbles; summed over the step's groups, maxima where a sum means nothing) and, for a pipeline,
    every stage's timeline of the same step's last group (JSON)."""
    out: dict[str, Any] = {}
    for group in stats.groups:
        for key, value in group.hooks.items():
            if not isinstance(value, int | float):
                continue
            if key in _HOOK_MAX:
                out[key] = max(out.get(key, value), value)
            elif key.endswith("_rank_min_s"):
                out[key] = min(out.get(key, value), value)
            else:
                out[key] = out.get(key, 0) + value
    if timelines is not None:
        out["pp_timelines"] = timelines
    return out


def grad_columns(model: torch.nn.Module, pp: int) -> dict[str, Any]:
    """The step's gradients in fp64, the same on every rank: ``grad_norm`` (L2 over all parameters) and
    ``grad_sha256`` (of every gradient's fp64 bytes, in parameter order; equal iff bitwise equal). Sharded
    gradients (DTensors) are gathered one parameter at a time, on every rank alike (a collective). A pipeline
    stage holds only its layers' gradients: under PP both are None."""
    if pp > 1:
        return {"grad_norm": None, "grad_sha256": None}
    digest, square = hashlib.sha256(), 0.0
    for _, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        if hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        flat = grad.detach().to(device="cpu", dtype=torch.float64).contiguous().reshape(-1)
        digest.update(flat.numpy().tobytes())
        square += float(flat.square().sum())
    return {"grad_norm": math.sqrt(square), "grad_sha256": digest.hexdigest()}


def _measure(cell: Cell, device: torch.device) -> list[dict[str, Any]]:
    """This rank's record per contender, with its raw per-step samples (merged on rank 0)."""
    from prefixflow.parallel import ParallelDims, build_mesh

    dims = ParallelDims.of(cell.parallel.model_dump())
    mesh = build_mesh(dims, device) if dims.world_size > 1 else None
    models, contenders, failures, extras = {}, {}, {}, {}
    for name in cell.systems:
        try:
            models[name], contenders[name] = _build(name, cell, device, dims, mesh)
            extras[name] = model_columns(models[name], cell, name)
        except Exception as e:
            failures[name] = (classify(e), traceback.format_exc())
    groups = []
    if models:
        vocab = next(iter(extras.values())).get("vocab_size")
        groups = [make_group(cell, vocab, i) for i in range(cell.groups_per_step)]
    samples: dict[str, list[dict]] = {name: [] for name in cell.systems}
    timed: dict[str, list] = {name: [] for name in cell.systems}  # (stats, timelines) per timed step

    grads: dict[str, dict] = {}  # the last timed step's gradient columns, per contender

    def step(name: str, track_memory: bool, last: bool = False):
        model = models[name]
        model.zero_grad(set_to_none=True)
        meter = PhaseMeter(device, model=model, track_memory=track_memory)
        with meter:
            stats = contenders[name].step(model, groups, cell, meter)
        res = meter.results()
        if last:  # untimed: after the meter
            grads[name] = grad_columns(model, cell.parallel.pp)
        model.zero_grad(set_to_none=True)
        return res, stats

    # Collectives need every rank in the same call order: a failing contender fails on every rank alike.
    for it in range(cell.warmup + cell.repeats):
        for name in cell.systems:
            if name in failures:
                continue
            try:
                res, stats = step(name, track_memory=False, last=it == cell.warmup + cell.repeats - 1)
            except Exception as e:
                failures[name] = (classify(e), traceback.format_exc())
                continue
            if it == 0:
                extras[name]["first_step_s"] = res["step_time_s"]
            if it >= cell.warmup:
                samples[name].append(res)
                timed[name].append((stats, _timelines(models[name])))  # not the memory step's below
    memory: dict[str, dict] = {}
    if device.type == "cpu" and not cell.compile:
        for name in cell.systems:
            if name in failures:
                continue
            try:
                memory[name], _ = step(name, track_memory=True)
            except Exception:
                memory[name] = {"mem_meter": "none", "mem_error": traceback.format_exc(limit=2)}
    records = []
    for name in cell.systems:
        rec = {**base_record(cell, str(device)), "system": name, **extras.get(name, {})}
        rec["threads"] = torch.get_num_threads()
        rec["rank"] = dist.get_rank() if dist.is_initialized() else 0
        if name in failures:
            rec["status"], rec["error"] = failures[name]
        else:
            # the hooks' counters and timelines of one step, the median one: communication times vary from
            # step to step like the step time, and one step's columns stay consistent with each other
            st, timelines = timed[name][median_step(samples[name])]
            rec.update(status="ok", error=None, loss=float(st.loss), **_step_columns(st), **grads[name])
            rec.update(_hook_columns(st, timelines))
            if timelines is not None:  # every timed step's, for the simulator's calibration
                rec["pp_timelines_steps"] = json.dumps([t for _, t in timed[name]])
            rec["samples"] = samples[name]
            mem = memory.get(name) or samples[name][0]
            for col in MEMORY:
                rec[col] = mem.get(col, math.nan)
            rec["mem_meter"] = mem.get("mem_meter", "none")
            rec["n_microbatches"] = sum(g.n_microbatches for g in st.groups)
            rec["prefix_tokens"] = sum(g.prefix_tokens for g in st.groups)
            rec["suffix_tokens"] = sum(g.suffix_tokens for g in st.groups)
        rec["tokens"] = sum(g.prompt_len * g.n + sum(g.response_lens) for g in groups) if groups else None
        if groups and name in models:
            system = get_contender(name)
            rec["attention"] = getattr(system, "attention_variant", lambda d: None)(device)
            lens = [g.response_lens for g in groups]
            rec.update(cost_columns(model_shape(models[name], cell), cell, system, lens, device))
        records.append(rec)
    return records


def median_step(samples: list[dict[str, Any]]) -> int:
    """Index of the timed step with the median step time (the lower middle one for an even count)."""
    order = sorted(range(len(samples)), key=lambda i: samples[i]["step_time_s"])
    return order[(len(order) - 1) // 2]


def _median(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def _spread(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    if not finite or max(finite) <= 0:
        return math.nan
    return (max(finite) - min(finite)) / max(finite)


def merge_rank_samples(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rank 0's records with the timed columns as the median over steps of the slowest rank, each rank's own
    median kept (``<col>_per_rank``, JSON) with its spread, memory as the max over ranks. A system that
    failed on any rank is failed with that rank's error."""
    merged = []
    for i, rec in enumerate(per_rank[0]):
        rows = [ranks[i] for ranks in per_rank]
        out = {k: v for k, v in rec.items() if k not in ("samples", "rank")}
        bad = next((r for r in rows if r.get("status") != "ok"), None)
        if bad is not None:
            out["status"], out["error"] = bad["status"], bad.get("error")
            for col in (*TIMED, *MEMORY):
                out.pop(col, None)
            merged.append(out)
            continue
        steps = min(len(r["samples"]) for r in rows)
        for col in TIMED:
            per_step = [max(r["samples"][s][col] for r in rows) for s in range(steps)]
            own = [_median([r["samples"][s][col] for s in range(steps)]) for r in rows]
            out[col] = _median(per_step)
            out[f"{col}_per_rank"] = json.dumps([None if math.isnan(v) else v for v in own])
            out[f"{col}_spread"] = _spread(own)
            if col == "step_time_s":
                out["step_time_min_s"], out["step_time_max_s"] = min(per_step), max(per_step)
        for col in MEMORY:
            own = [float(r.get(col, math.nan)) for r in rows]
            finite = [v for v in own if not math.isnan(v)]
            out[col] = max(finite) if finite else math.nan
            out[f"{col}_per_rank"] = json.dumps([None if math.isnan(v) else v for v in own])
            out[f"{col}_spread"] = _spread(own)
        if "first_step_s" in rec:
            out["first_step_s"] = max(r.get("first_step_s", math.nan) for r in rows)
        merged.append(out)
    return merged


def run_parallel_step_cell(cell: Cell, memory_only: bool = False) -> list[dict[str, Any]] | None:
    """Measure ``cell`` on this rank; rank 0 returns the merged records, other ranks None. Needs the
    process group's environment (local ranks, Slurm) when the layout has more than one rank."""
    if memory_only:
        return failed_records(cell, "error", "capacity-frontier probes run on one rank only")
    try:
        device = resolve_device(cell.device)
        if cell.world_size > 1:
            from prefixflow.parallel import init_distributed

            device = init_distributed(device)
            if dist.get_world_size() != cell.world_size:
                raise ValueError(
                    f"cell layout {cell.parallel.label} needs {cell.world_size} ranks, got {dist.get_world_size()}"
                )
    except Exception:
        return failed_records(cell, "error", traceback.format_exc())
    records = _measure(cell, device)
    if cell.world_size == 1:
        return merge_rank_samples([records])
    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(records, gathered, dst=0)
    return merge_rank_samples(gathered) if dist.get_rank() == 0 else None
