"""What ``train_group`` checks before any gradient changes (one ``ValueError``/``TypeError`` naming the field)."""

from __future__ import annotations

import torch
from torch import nn

from .adapters import adapter_for
from .apply import runtime_of
from .budget import AUTO
from .compile import is_compiled
from .group import RolloutGroup
from .hooks import hooks_of
from .layouts import LAYOUTS

__all__ = ["SYSTEMS", "validate_call", "compute_dtype"]

SYSTEMS = ("prefixflow", "baseline")


def validate_call(model: nn.Module, group: RolloutGroup, system: str, layout: str, microbatch) -> None:
    """Raise ``ValueError``/``TypeError`` naming the field for input ``train_group`` cannot run: the system,
    layout and microbatch, what the model's stage, adapter and hooks refuse, and the group's fit."""
    if not isinstance(group, RolloutGroup):
        raise TypeError(f"group must be a prefixflow.RolloutGroup, got {type(group).__name__}")
    if system not in SYSTEMS:
        raise ValueError(f"system {system!r} unknown; valid systems: {SYSTEMS}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} unknown; valid layouts: {LAYOUTS}")
    runtime = runtime_of(model)
    if microbatch == AUTO:
        if runtime.config.memory_budget_bytes is None:
            raise ValueError(
                "microbatch='auto' needs a memory budget: apply_prefixflow(model, "
                "PrefixFlowConfig(memory_budget_bytes=...)), or pass an int microbatch"
            )
        if is_compiled(model):
            raise ValueError(
                "microbatch='auto' measures memory with a dispatch mode, which compiled blocks cannot run "
                "under; pass an int microbatch with apply_compile"
            )
    elif microbatch is not None and (
        isinstance(microbatch, bool) or not isinstance(microbatch, int) or microbatch < 1
    ):
        raise ValueError(
            f"microbatch must be None (all responses), an int >= 1 or 'auto', got {microbatch!r}"
        )
    runtime.stage.check(model, system, microbatch)
    adapter = adapter_for(model)
    group.check_fits(adapter.vocab_size(model), adapter.max_seq_len(model))
    group.check_representable(compute_dtype(model))
    adapter.check(model, group)
    if group.routing is not None and getattr(model, "_prefixflow_moe", None) is None:
        raise ValueError("group.routing replays MoE expert choices, but this model has no MoE layers")
    hooks_of(model).check(model, group, system)


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the loss is computed in: the parameters' dtype, at least fp32 (see ``token_logprobs``)."""
    return torch.promote_types(next(model.parameters()).dtype, torch.float32)
