"""``apply_moe``: make a TorchTitan MoE model run on any device and replay routing under both systems."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from ..hooks import add_hooks
from ..model.models import register_build_step
from ..runtime import runtime_of
from .layers import CountingReorderer, PortableExperts, ReplayMoE, ReplayRouter, swap_class
from .schedule_hooks import MoEScheduleHooks

__all__ = ["MoEConfig", "apply_moe", "moe_hooks_of", "is_moe"]


@dataclass(frozen=True)
class MoEConfig:
    """How the MoE layers train.

    ``aux_loss_coef``: weight ``alpha`` of the auxiliary load-balancing loss ``alpha * E * sum_e f_e * P_e``
    per MoE layer, over the group's logical tokens (0 = off, TorchTitan 0.2.2 has none). ``f_e``: fraction
    of the group's routed slots on expert e (from the routing masks, so it needs ``group.routing``); ``P_e``:
    mean router probability of e. ``capacity_factor``: None = dropless (TorchTitan); a float caps each expert
    at ``ceil(cf * tokens * k / E)`` assignments per forward and drops the rest, which depends on the batch
    and is rejected together with routing replay.
    """

    aux_loss_coef: float = 0.0
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        coef = self.aux_loss_coef
        if (
            isinstance(coef, bool)
            or not isinstance(coef, (int, float))
            or not math.isfinite(coef)
            or coef < 0
        ):
            raise ValueError(f"MoEConfig.aux_loss_coef must be a finite number >= 0, got {coef!r}")
        cf = self.capacity_factor
        if cf is not None and (
            isinstance(cf, bool) or not isinstance(cf, (int, float)) or not math.isfinite(cf) or cf <= 0
        ):
            raise ValueError(f"MoEConfig.capacity_factor must be None (dropless) or a number > 0, got {cf!r}")


def _titan_moe_layers(model: nn.Module) -> list[nn.Module]:
    from torchtitan.models.moe.moe import MoE

    return [m for m in model.modules() if isinstance(m, MoE)]


def is_moe(model: nn.Module) -> bool:
    """Whether the model has TorchTitan MoE layers."""
    return bool(getattr(getattr(model, "model_args", None), "moe_enabled", False)) or bool(
        _titan_moe_layers(model)
    )


def apply_moe(model: nn.Module, config: MoEConfig | None = None) -> nn.Module:
    """Swap in the replay-capable MoE layers (in place, idempotent) and register their schedule hooks.

    ``build_model`` applies it to every MoE flavour; call it again to change the :class:`MoEConfig`.
    Apply it before any parallelism: TorchTitan's expert-parallel plans then wrap the swapped modules.
    """
    config = config or MoEConfig()
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a prefixflow.MoEConfig, got {type(config).__name__}")
    layers = _titan_moe_layers(model)
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no MoE layers; build an MoE flavour (e.g. qwen3:30B-A3B)"
        )
    for index, moe in enumerate(layers):
        if getattr(moe, "moe_index", None) is None:  # numbered once, on the whole model: a pipeline stage
            moe.moe_index, moe.moe_count = index, len(layers)  # keeps its layers' places in the routing masks
        swap_class(moe, ReplayMoE)
        swap_class(moe.router, ReplayRouter)
        swap_class(moe.reorderer, CountingReorderer)
        swap_class(moe.experts, PortableExperts)
        moe.capacity_factor = config.capacity_factor
    runtime = runtime_of(model, create=True)
    if runtime.moe is None:
        runtime.moe = add_hooks(model, MoEScheduleHooks(config))
    else:
        runtime.moe.config = config
    return model


def moe_hooks_of(model: nn.Module) -> MoEScheduleHooks:
    """The MoE schedule hooks ``apply_moe`` registered (``.config``, ``.aux_loss`` of the last group)."""
    hooks = runtime_of(model, create=True).moe
    if hooks is None:
        raise ValueError("this model has no MoE hooks; call prefixflow.moe.apply_moe(model) first")
    return hooks


def _apply_moe_to_moe_flavours(model: nn.Module) -> None:
    """``build_model``'s step for MoE flavours: CPU-capable routing/experts and routing replay (GPU keeps
    TorchTitan's grouped GEMMs)."""
    if getattr(getattr(model, "model_args", None), "moe_enabled", False):
        apply_moe(model)


register_build_step(_apply_moe_to_moe_flavours)
