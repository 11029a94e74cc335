"""A cell whose step is the data-parallel step (``prefixflow.parallel.train_step`` over the cell's groups),
on one rank or many: every rank measures its own steps; rank 0 merges them into the cell's records.

Runs in each rank of a local launch or a Slurm multi-task job (``harness.execute`` starts them), or in one
process for a single-rank cell with several groups per step. Each contender gets its own model copy, built
from the same seed and parallelized in TorchTitan's order (``prefixflow.parallel.parallelize``); a step is
the contender's ``step`` over the cell's groups (one per data-parallel rank unless the cell says
otherwise), measured by the one loop of ``harness.run.loop`` (systems interleaved, warm-up, repeats, memory).

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
import traceback
from typing import Any

import torch
import torch.distributed as dist

from harness.contenders import get_contender
from harness.run.columns import (
    OFFLOAD_BYTES,
    base_record,
    cost_columns,
    failed_records,
    model_columns,
    model_shape,
    offload_columns,
)
from harness.run.loop import SystemRun, cell_records, median_step, merge_ranks, run_systems
from harness.run.setup import build_cell_model, make_group, resolve_device
from harness.spec.cell import Cell
from prefixflow.memory.offload import OffloadStats

__all__ = ["run_parallel_step_cell", "measure_rank", "merge_rank_samples", "median_step"]


def _fresh(name: str, cell: Cell, device: torch.device):
    """The contender ``name`` and its fresh model (the cell's seed), prepared by it, not parallelized."""
    contender = get_contender(name)
    model = build_cell_model(cell, device)
    return contender, contender.prepare(model, cell)


def _parallelized(model, contender, cell: Cell, dims, mesh):
    """``model`` parallelized in TorchTitan's order (one rank: AC and compile only)."""
    from prefixflow.parallel import parallelize

    if dims.world_size > 1:  # a contender may turn a knob of the parallel schedule (e.g. CP prefetch off)
        options = getattr(contender, "parallel_options", {})
        return parallelize(model, dims, ac=cell.ac, compile=cell.compile, mesh=mesh, **options)
    from prefixflow import apply_ac

    apply_ac(model, cell.ac)
    if cell.compile:
        from prefixflow.model.compile import apply_compile

        apply_compile(model)
    return model


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


class ParallelBench:
    """The data-parallel step over the cell's groups on this rank, each system parallelized in TorchTitan's
    order; no FLOP counting; after each timed step, a pipeline's timelines, and after the last one the
    gradient digests."""

    count_flops = False

    def __init__(self, cell: Cell, device: torch.device) -> None:
        from prefixflow.parallel import ParallelDims, build_mesh

        self.cell, self.device = cell, device
        self.dims = ParallelDims.of(cell.parallel.model_dump())
        self.mesh = build_mesh(self.dims, device) if self.dims.world_size > 1 else None
        self.columns: dict[str, dict[str, Any]] = {}
        self.shapes: dict[str, Any] = {}

    def fresh(self, name: str):
        return _fresh(name, self.cell, self.device)

    def parallelized(self, name: str, contender, model):
        """``model`` parallelized on this rank; its record columns are the parallelized model's."""
        model = _parallelized(model, contender, self.cell, self.dims, self.mesh)
        self.columns[name] = model_columns(model, self.cell, name)
        self.shapes[name] = model_shape(model, self.cell)
        return contender, model

    def inputs(self, runs: list[SystemRun]) -> list:
        vocab = self.columns[runs[0].name].get("vocab_size")
        return [make_group(self.cell, vocab, i) for i in range(self.cell.groups_per_step)]

    def prepare(self, runs: list[SystemRun], step) -> None:
        pass

    def inspect(self, run: SystemRun, last: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"timelines": _timelines(run.model)}
        if last:
            out.update(grad_columns(run.model, self.cell.parallel.pp))
        return out


def measure_rank(cell: Cell, device: torch.device, runner=None) -> list[dict[str, Any]]:
    """This rank's record per system, with its raw per-step samples (merged on rank 0). ``runner``: the loop
    (default :func:`~harness.run.loop.run_systems`; an estimate's has its signature)."""
    bench = ParallelBench(cell, device)
    runs, groups = run_systems(cell, device, bench) if runner is None else runner(cell, device, bench)
    records = []
    for run in runs:
        rec = {**base_record(cell, str(device)), "system": run.name, **bench.columns.get(run.name, {})}
        rec["threads"] = torch.get_num_threads()
        rec["rank"] = dist.get_rank() if dist.is_initialized() else 0
        if run.failure is not None:
            rec["status"], rec["error"] = run.failure
        else:
            # the hooks' counters and timelines of one step, the median one: communication times vary from
            # step to step like the step time, and one step's columns stay consistent with each other
            median = median_step(run.samples)
            inspected = run.inspected or [{}]  # an estimate inspects nothing: no values
            st, timelines = run.stats[median], inspected[min(median, len(inspected) - 1)].get("timelines")
            grads = {k: inspected[-1].get(k) for k in ("grad_norm", "grad_sha256")}
            loss = float(st.loss) if st.loss is not None else None
            rec.update(status="ok", error=None, loss=loss, **_step_columns(st), **grads)
            rec.update(_hook_columns(st, timelines))
            rec.update(offload_columns(cell, run.name, None, _step_offload(st.groups)))
            if timelines is not None:  # every timed step's, for the simulator's calibration
                rec["pp_timelines_steps"] = json.dumps([i["timelines"] for i in run.inspected])
            rec.update(samples=run.samples, memory=run.memory, first_step_s=run.first_step_s)
            rec["n_microbatches"] = sum(g.n_microbatches for g in st.groups)
            rec["prefix_tokens"] = sum(g.prefix_tokens for g in st.groups)
            rec["suffix_tokens"] = sum(g.suffix_tokens for g in st.groups)
        rec["tokens"] = sum(g.prompt_len * g.n + sum(g.response_lens) for g in groups) if groups else None
        if groups and run.name in bench.shapes:
            system = get_contender(run.name)
            rec["attention"] = getattr(system, "attention_variant", lambda d: None)(device)
            lens = [g.response_lens for g in groups]
            rec.update(cost_columns(bench.shapes[run.name], cell, system, lens, device))
        records.append(rec)
    return records


def _step_offload(groups) -> OffloadStats | None:
    """What this rank's offloads moved over the step's groups, summed."""
    stats = [g.offload for g in groups if g.offload is not None]
    if not stats:
        return None
    moved = {key: sum(getattr(s, key) for s in stats) for key in OFFLOAD_BYTES}
    return OffloadStats(tier=stats[0].tier, prefetch=stats[0].prefetch, **moved)


def merge_rank_samples(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The data-parallel step's records from every rank's: :func:`harness.run.loop.merge_ranks` with each
    rank's own values and their spread."""
    return merge_ranks(per_rank, per_rank_columns=True)


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
    records = measure_rank(cell, device)
    if cell.world_size == 1:
        return cell_records(cell, [records], per_rank_columns=True)
    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(records, gathered, dst=0)
    return cell_records(cell, gathered, per_rank_columns=True) if dist.get_rank() == 0 else None
