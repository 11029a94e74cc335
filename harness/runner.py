"""One cell: build a model copy per system, warm up, run interleaved repeats, measure, make records."""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import math
import os
import socket
import statistics
import subprocess
import traceback
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from harness.measure import PhaseMeter, rank_max
from harness.spec import Cell
from harness.systems import get_system

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
REPO_ROOT = Path(__file__).resolve().parent.parent
OFFLOAD_BYTES = ("offloaded_bytes", "prefetched_bytes", "demand_loaded_bytes", "late_bytes", "dropped_bytes")
HF_PREFIX = "hf:"
_OOM_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory")


@functools.cache
def git_rev() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    rev = out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"
    if rev != "unknown":  # uncommitted changes to tracked files: the revision alone does not say what ran
        try:
            dirty = subprocess.run(
                ["git", "diff", "--quiet", "HEAD", "--"], cwd=REPO_ROOT, capture_output=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return rev
        if dirty.returncode == 1:
            rev += "-dirty"
    return rev


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but torch.cuda.is_available() is False")
    return torch.device(name)


def classify(exc: BaseException) -> str:
    """'oom' for allocator failures (CUDA or host), else 'error'."""
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return "oom"
    return "oom" if any(t in str(exc).lower() for t in _OOM_TEXT) else "error"


def base_record(cell: Cell, device: str = "") -> dict[str, Any]:
    """The columns every row of a cell shares (also used for error/timeout rows written by executors)."""
    par = cell.parallel
    return {
        "cell_id": cell.cell_id,
        "spec": cell.spec,
        "git_rev": git_rev(),
        "timestamp": datetime.now(UTC).isoformat(timespec="milliseconds"),
        "host": socket.gethostname(),
        "device": device or cell.device,
        "model": cell.model.display,
        "model_overrides": json.dumps(cell.model.overrides, sort_keys=True),
        "dtype": cell.dtype,
        "prefix_len": cell.prefix_len,
        "suffix_len": cell.suffix_len,
        "n": cell.n,
        "prefix_ratio": cell.prefix_ratio,
        "suffix_spread": cell.suffix_spread,
        "layout": cell.layout,
        "microbatch": None if cell.microbatch == "auto" else cell.microbatch,
        "microbatch_auto": cell.microbatch == "auto",
        "memory_budget": None if cell.memory_budget is None else str(cell.memory_budget),
        "compile": cell.compile,
        "ac": cell.ac,
        "offload": cell.offload,
        "dp_replicate": par.dp_replicate,
        "dp_shard": par.dp_shard,
        "tp": par.tp,
        "cp": par.cp,
        "pp": par.pp,
        "dp": par.batch,  # the data-parallel degree (dp_replicate x dp_shard)
        "ep": par.ep,
        "world_size": cell.world_size,
        "parallel_layout": par.label,
        "groups_per_step": cell.groups_per_step,
        "warmup": cell.warmup,
        "repeats": cell.repeats,
        "seed": cell.seed,
        "config": cell.model_dump_json(),
    }


def failed_records(cell: Cell, status: str, error: str, device: str = "") -> list[dict[str, Any]]:
    """One row per system of the cell, all with ``status`` and ``error``."""
    return [
        {**base_record(cell, device), "system": s, "status": status, "error": error} for s in cell.systems
    ]


def make_group(cell: Cell, vocab_size: int, index: int = 0):
    """A deterministic synthetic rollout group: prompt of P tokens, N responses of length S (or, with
    ``suffix_spread`` > 0, uniform in [ceil(S*(1-spread)), S]), advantages ~ N(0, 1). ``index``: which
    group of a multi-group step (each its own draw; index 0 is the single-group cell's group)."""
    from prefixflow import RolloutGroup

    gen = torch.Generator().manual_seed(cell.seed + 1_000_003 * index)
    prompt = torch.randint(0, vocab_size, (cell.prefix_len,), generator=gen)
    if cell.suffix_spread > 0:
        low = max(1, math.ceil(cell.suffix_len * (1 - cell.suffix_spread)))
        lens = torch.randint(low, cell.suffix_len + 1, (cell.n,), generator=gen).tolist()
    else:
        lens = [cell.suffix_len] * cell.n
    responses = [torch.randint(0, vocab_size, (s,), generator=gen) for s in lens]
    advantages = torch.randn(cell.n, generator=gen, dtype=torch.float64)
    return RolloutGroup(prompt=prompt, responses=responses, advantages=advantages)


def build_cell_model(cell: Cell, device: torch.device) -> torch.nn.Module:
    """The cell's model with its seed's random weights: TorchTitan ``family:flavor``, or ``hf:<built-in config
    name | local config.json path>`` through ``prefixflow.integrations.hf`` (needs ``prefixflow[hf]``)."""
    kwargs = {
        "dtype": DTYPES[cell.dtype],
        "seed": cell.seed,
        "overrides": dict(cell.model.overrides),
        "device": device,
    }
    if cell.model.name.startswith(HF_PREFIX):
        from prefixflow.integrations.hf import build_hf_model

        return build_hf_model(cell.model.name.removeprefix(HF_PREFIX), **kwargs)
    from prefixflow import build_model

    return build_model(cell.model.name, **kwargs)


def with_routing(group, model: torch.nn.Module):
    """MoE models train under Rollout Routing Replay (the paper's MoE setting): the group carries the routing
    masks a rollout engine records, here recorded on ``model`` (untimed; the prefix routed once)."""
    from prefixflow.moe import is_moe, record_routing

    if not is_moe(model):
        return group
    return dataclasses.replace(group, routing=record_routing(model, group))


def build_for(system_name: str, cell: Cell, device: torch.device):
    """A fresh model (same seed for every system) transformed for ``system_name``."""
    from prefixflow import apply_ac

    system = get_system(system_name)
    model = build_cell_model(cell, device)
    apply_ac(model, cell.ac)
    model = system.prepare(model, cell)
    if cell.compile:
        from prefixflow.compile import apply_compile

        apply_compile(model)  # per-block, shared by both systems; the first (warm-up) step pays compile time
    return system, model


def _model_shape(model: torch.nn.Module, cell: Cell):
    """The cost model's :class:`~harness.costmodel.ModelShape` of ``model`` (None when it has none)."""
    from harness import costmodel
    from prefixflow import model_args

    try:
        args = model.config if cell.model.name.startswith(HF_PREFIX) else model_args(model)
        return costmodel.as_shape(args)
    except (TypeError, ValueError, AttributeError):
        return None


def _model_columns(model: torch.nn.Module, cell: Cell, system: str) -> dict[str, Any]:
    """Model shape columns, so figures need nothing but the table."""
    shape = _model_shape(model, cell)
    if shape is None:
        return {}
    out: dict[str, Any] = dict(
        dim=shape.dim,
        n_layers=shape.n_layers,
        n_heads=shape.n_heads,
        n_kv_heads=shape.n_kv_heads,
        head_dim=shape.head_dim,
        hidden_dim=shape.hidden_dim,
        vocab_size=shape.vocab_size,
        n_params=sum(p.numel() for p in model.parameters()),
    )
    if hasattr(shape, "num_experts"):  # MoE: the parameters one token runs through, and replayed routing
        from harness.costmodel_moe import active_params_per_token

        out.update(n_active_params=active_params_per_token(shape), routing="replay")
    return out


def _cost_columns(shape, cell: Cell, system: Any, lens, device, stats=None) -> dict[str, Any]:
    """The FLOP model of what ``system`` executes on this cell's step (``harness.costmodel``): its modelled
    FLOPs (GEMM and attention; activation checkpointing off only, NaN otherwise), the corrected ideal
    speedup, and the paper's §3.1 ideal. ``lens``: the group's response lengths, or one list per group of a
    multi-group step (summed over the groups, wherever they ran)."""
    from harness import costmodel

    cost_name = getattr(system, "cost_model", None)
    if shape is None or cost_name not in costmodel.SYSTEMS:
        return {}
    groups = [list(g) for g in lens] if lens and not isinstance(lens[0], int) else [list(lens)]
    p, layout, mb = cell.prefix_len, cell.layout, cell.microbatch
    if mb == "auto":  # the sizes this system's plan chose (the ideal: the baseline one sequence at a time)
        plan = getattr(stats, "plan", None)
        mb = plan["microbatch_sizes"] if plan else 1
    ideal_mb = 1 if cell.microbatch == "auto" else mb
    variant = getattr(system, "attention_variant", lambda d: None)(device) or "split"
    base = least = 0
    modelled = costmodel.Flops(0, 0)
    for g in groups:
        base += costmodel.model_flops("baseline", shape, p, g, layout=layout, microbatch=ideal_mb)
        least += costmodel.least_prefixflow_flops(shape, p, g).total
        modelled += costmodel.executed_flops(
            cost_name, shape, p, g, layout=layout, microbatch=mb, attention=variant
        )
    all_lens = [s for g in groups for s in g]
    out = {
        "ideal_speedup": base / least,
        "paper_ideal_speedup": costmodel.paper_ideal_speedup(
            shape, p, round(sum(all_lens) / len(all_lens)), len(groups[0])
        ),
    }
    known = cell.ac == "none"
    out["model_flops"] = float(modelled.total) if known else math.nan
    out["model_gemm_flops"] = float(modelled.gemm) if known else math.nan
    out["model_attention_flops"] = float(modelled.attention) if known else math.nan
    return out


def _counted_columns(counted) -> dict[str, Any]:
    if counted is None:
        return {}
    return {
        "counted_flops": float(counted.total),
        "counted_gemm_flops": float(counted.gemm),
        "counted_attention_flops": float(counted.attention),
    }


def _summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [s["step_time_s"] for s in samples]
    out = {
        "step_time_s": statistics.median(steps),
        "step_time_min_s": min(steps),
        "step_time_max_s": max(steps),
    }
    for key in ("phase_a_s", "phase_b_s", "phase_c_s"):
        vals = [s[key] for s in samples]
        out[key] = math.nan if any(math.isnan(v) for v in vals) else statistics.median(vals)
    return out


def _memory_columns(mem: dict[str, Any] | None, samples: list[dict[str, Any]], cell: Cell) -> dict[str, Any]:
    """Peak-memory columns: from the memory step on CPU, from the timed steps on CUDA."""
    src = [mem] if mem is not None else samples
    if src[0]["mem_meter"] == "none":
        why = "none (torch.compile cannot run under the CPU live-bytes meter)" if cell.compile else "none"
        return {"peak_mem_bytes": math.nan, "peak_mem_phase_b_bytes": math.nan, "mem_meter": why}
    return {
        "peak_mem_bytes": max(s["peak_mem_bytes"] for s in src),
        "peak_mem_phase_b_bytes": max(s["peak_mem_phase_b_bytes"] for s in src),
        "offloaded_peak_bytes": max(s.get("offloaded_peak_bytes", math.nan) for s in src),
        "offloaded_peak_phase_b_bytes": max(s.get("offloaded_peak_phase_b_bytes", math.nan) for s in src),
        "mem_meter": src[0]["mem_meter"],
    }


def _release(model: torch.nn.Module | None, device: torch.device) -> None:
    if model is not None:
        model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _offload_columns(cell: Cell, name: str, system: Any, stats: Any) -> dict[str, Any]:
    """Whether this system offloaded (the baseline never does) and, if so, what its offload moved."""
    off = getattr(stats, "offload", None)
    if system is None:
        try:
            system = get_system(name)
        except ValueError:
            system = None
    out: dict[str, Any] = {"offload": bool(cell.offload and getattr(system, "uses_offload", True))}
    out["offload_tier"] = off.tier if off is not None else None
    for key in OFFLOAD_BYTES:
        out[key] = getattr(off, key) if off is not None else None
    return out


def run_cell(cell: Cell, memory_only: bool = False) -> list[dict[str, Any]] | None:
    """Run every system of ``cell`` interleaved (A B A B ...); one record per system, never raises for
    a failing system (status error/oom with the traceback). ``memory_only`` (capacity probes): on CPU one
    step per system with the live-bytes meter and no timed steps; on CUDA one step and no warm-up."""
    try:
        device = resolve_device(cell.device)
    except RuntimeError:
        return failed_records(cell, "error", traceback.format_exc())
    if cell.parallel != type(cell.parallel)():
        from prefixflow.parallel import ParallelDims, check_supported

        try:
            check_supported(ParallelDims.of(cell.parallel.model_dump()))
        except ValueError as e:
            return failed_records(cell, "error", str(e), str(device))
    if cell.world_size > 1 and os.environ.get("WORLD_SIZE") != str(cell.world_size):
        from harness.launch import run_cell_local_ranks

        return run_cell_local_ranks(cell)  # its ranks come back here, on local ranks
    if cell.world_size != 1 or cell.groups_per_step != 1:
        from harness.rank_runner import run_cell_ranks

        return run_cell_ranks(cell, memory_only=memory_only)  # None on ranks other than 0

    systems, models, failures, extras, shapes = {}, {}, {}, {}, {}
    for name in cell.systems:
        try:
            systems[name], models[name] = build_for(name, cell, device)
            extras[name] = _model_columns(models[name], cell, name)
            shapes[name] = _model_shape(models[name], cell)
        except Exception as e:
            failures[name] = (classify(e), traceback.format_exc())
    group = None
    if models:
        try:
            vocab = extras[next(iter(models))].get("vocab_size") or _vocab(next(iter(models.values())))
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
        """One step; ``count``: under the FLOP counters too (harness.costmodel.count_flops), untimed."""
        from harness.costmodel import count_flops

        model = models[name]
        try:
            model.zero_grad(set_to_none=True)
            meter = PhaseMeter(device, model=model, track_memory=track_memory)
            with meter:
                if count:
                    counted[name], stats = count_flops(lambda: systems[name].step(model, group, cell, meter))
                else:
                    stats = systems[name].step(model, group, cell, meter)
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
        system = systems.get(name)
        rec["attention"] = getattr(system, "attention_variant", lambda d: None)(device)
        if group is not None and name in shapes:
            rec.update(
                _cost_columns(shapes[name], cell, system, group.response_lens, device, last_stats.get(name))
            )
        rec.update(_counted_columns(counted.get(name)))
        if cell.memory_budget is not None:
            rec["memory_budget_bytes"] = budget
            plan = getattr(last_stats.get(name), "plan", None)
            if plan:
                rec["microbatch_sizes"] = ",".join(map(str, plan["microbatch_sizes"]))
                rec["auto_resident_bytes"] = plan["resident_bytes"]
                rec["auto_per_token_bytes"] = plan["per_token_bytes"]
        rec.update(_offload_columns(cell, name, systems.get(name), last_stats.get(name)))
        if name in failures:
            rec["status"], rec["error"] = failures[name]
        else:
            rec.update(status="ok", error=None, **_summarize(samples[name]))
            rec.update(_memory_columns(memory.get(name), samples[name], cell))
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
    from harness.spec import PEAK_OF

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

    for model in models.values():
        runtime = getattr(model, "_prefixflow", None)
        if model is not None and runtime is not None:
            apply_prefixflow(model, replace(runtime.config, memory_budget_bytes=budget))


def _vocab(model: torch.nn.Module) -> int:
    from prefixflow import adapter_for

    return int(adapter_for(model).vocab_size(model))
