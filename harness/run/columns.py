"""The columns of a cell's records: what the cell was (``base_record``), and what each system's steps
measured: times, peak memory, offload traffic, model shape, modelled and counted FLOPs."""

from __future__ import annotations

import functools
import json
import math
import os
import socket
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from harness.contenders import get_contender
from harness.run.setup import HF_PREFIX
from harness.spec.cell import Cell

REPO_ROOT = Path(__file__).resolve().parents[2]
OFFLOAD_BYTES = ("offloaded_bytes", "prefetched_bytes", "demand_loaded_bytes", "late_bytes", "dropped_bytes")
COST_COLUMNS = (
    "ideal_speedup", "paper_ideal_speedup", "model_flops", "model_gemm_flops", "model_attention_flops",
    "model_recurrent_flops",
)  # fmt: skip
_OOM_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory")


@functools.cache
def git_rev() -> str:
    """HEAD's short revision (``-dirty`` with uncommitted changes to tracked files). Outside a git checkout,
    ``$PF_GIT_REV``: scripts/gpu_check.sh sets it on a machine the tree travelled to without ``.git``, after
    checking the tree against the stamp ``make gpu-wheels`` wrote; else ``unknown``."""
    rev = _git_rev()
    if rev == "unknown":
        return os.environ.get("PF_GIT_REV") or rev
    return rev


def _git_rev() -> str:
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
        "lora_r": None if cell.model.lora is None else cell.model.lora.r,
        "lora_alpha": None if cell.model.lora is None else float(cell.model.lora.alpha),
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


def model_shape(model: torch.nn.Module, cell: Cell):
    """The cost model's :class:`~harness.costmodel.flops.ModelShape` of ``model`` (None when it has none)."""
    from harness.costmodel import flops
    from prefixflow import model_args

    try:
        if cell.model.name.startswith(HF_PREFIX) and hasattr(model.config, "vision_config"):
            return _vision_shape(model, cell)
        args = model.config if cell.model.name.startswith(HF_PREFIX) else model_args(model)
        return flops.as_shape(args)
    except (TypeError, ValueError, AttributeError):
        return None


def _vision_shape(model: torch.nn.Module, cell: Cell):
    """A vision-language model's cost-model shape: its language model, its tower and the cell's images."""
    from harness.costmodel import flops
    from harness.costmodel.vision import vision_shape

    config = model.config
    grids = cell.vision.grids(config.vision_config.spatial_merge_size) if cell.vision is not None else ()
    trains = any(p.requires_grad for p in model.model.visual.parameters())
    return vision_shape(flops.as_shape(config.text_config), config, grids, trains)


def model_columns(model: torch.nn.Module, cell: Cell, system: str) -> dict[str, Any]:
    """Model shape columns, so figures need nothing but the table."""
    shape = model_shape(model, cell)
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
        from harness.costmodel.moe import active_params_per_token

        out.update(n_active_params=active_params_per_token(shape), routing="replay")
    return out


def cost_columns(shape, cell: Cell, system: Any, lens, device, stats=None) -> dict[str, Any]:
    """The FLOP model of what ``system`` executes on this cell's step (``harness.costmodel.flops``): its modelled
    FLOPs (GEMM, attention and a hybrid's recurrent kernels; activation checkpointing off only, NaN otherwise),
    the corrected ideal speedup, and the paper's §3.1 ideal. ``lens``: the group's response lengths, or one list
    per group of a multi-group step (summed over the groups, wherever they ran).

    LoRA cells get NaN in every cost column: the FLOP model counts full fine-tuning (every weight's gradient
    GEMM); with frozen base weights those are skipped and the adapters' GEMMs added, which it does not model.
    Their counted FLOPs (``counted_columns``) are what ran."""
    from harness.costmodel import flops

    cost_name = getattr(system, "cost_model", None)
    covered = getattr(shape, "systems", flops.SYSTEMS)  # a hybrid's: baseline and PrefixFlow
    if shape is None or cost_name not in covered:
        return {}
    if cell.model.lora is not None:
        return dict.fromkeys(COST_COLUMNS, math.nan)
    groups = [list(g) for g in lens] if lens and not isinstance(lens[0], int) else [list(lens)]
    p, layout, mb = cell.prefix_len, cell.layout, cell.microbatch
    if mb == "auto":  # the sizes this system's plan chose (the ideal: the baseline one sequence at a time)
        plan = getattr(stats, "plan", None)
        mb = plan["microbatch_sizes"] if plan else 1
    ideal_mb = 1 if cell.microbatch == "auto" else mb
    variant = getattr(system, "attention_variant", lambda d: None)(device) or "split"
    base = least = 0
    modelled = flops.Flops(0, 0)
    for g in groups:
        base += flops.model_flops("baseline", shape, p, g, layout=layout, microbatch=ideal_mb)
        least += flops.least_prefixflow_flops(shape, p, g).total
        modelled += flops.executed_flops(
            cost_name, shape, p, g, layout=layout, microbatch=mb, attention=variant
        )
    all_lens = [s for g in groups for s in g]
    out = {
        "ideal_speedup": base / least,
        "paper_ideal_speedup": flops.paper_ideal_speedup(
            shape, p, round(sum(all_lens) / len(all_lens)), len(groups[0])
        ),
    }
    known = cell.ac == "none"
    out["model_flops"] = float(modelled.total) if known else math.nan
    out["model_gemm_flops"] = float(modelled.gemm) if known else math.nan
    out["model_attention_flops"] = float(modelled.attention) if known else math.nan
    out["model_recurrent_flops"] = float(modelled.recurrent) if known else math.nan
    return out


def vision_columns(cell: Cell, group, stats, shape=None, system: str = "") -> dict[str, Any]:
    """A vision cell's workload and tower columns: the shape, the tower's mode, the prompt's visual tokens, and
    what the tower ran (``GroupStats``: patches encoded, rows that ran it, its counted forward FLOPs) beside the
    cost model's tower FLOPs (forward and backward, every run)."""
    from harness.costmodel.vision import VisionShape, tower_work

    shape_ = cell.vision
    out: dict[str, Any] = {
        "vision_workload": shape_.kind,  # not ``workload``: that column marks tree cells (their own figures)
        "vision_label": shape_.label,
        "vision_params": shape_.model_dump_json(),
        "tower": cell.tower,
        "visual_tokens": shape_.visual_tokens,
        "vision_prefix_ratio": (
            cell.prefix_len / (cell.prefix_len + sum(group.response_lens) / group.n) if group else math.nan
        ),
        "vision_tokens": getattr(stats, "vision_tokens", None),
        "vision_runs": getattr(stats, "vision_runs", None),
        "vision_flops": getattr(stats, "vision_flops", None),
    }
    if isinstance(shape, VisionShape) and group is not None:
        out["model_vision_flops"] = float(tower_work(shape, system, group.n).total)
    return out


def counted_columns(counted) -> dict[str, Any]:
    if counted is None:
        return {}
    return {
        "counted_flops": float(counted.total),
        "counted_gemm_flops": float(counted.gemm),
        "counted_attention_flops": float(counted.attention),
        "counted_recurrent_flops": float(counted.recurrent),
    }


def offload_columns(cell: Cell, name: str, system: Any, off: Any) -> dict[str, Any]:
    """Whether this system offloaded (the baseline never does) and, if so, what its offload moved (``off``:
    the step's ``OffloadStats``, or None)."""
    if system is None:
        try:
            system = get_contender(name)
        except ValueError:
            system = None
    out: dict[str, Any] = {"offload": bool(cell.offload and getattr(system, "uses_prefixflow_config", True))}
    out["offload_tier"] = off.tier if off is not None else None
    for key in OFFLOAD_BYTES:
        out[key] = getattr(off, key) if off is not None else None
    return out
