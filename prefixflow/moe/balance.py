"""Aux-loss-free load balancing: TorchTitan's expert-bias update, driven by the logical token counters."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .schedule_hooks import moe_layers

__all__ = ["update_expert_bias", "tokens_per_expert"]


def tokens_per_expert(model: nn.Module) -> torch.Tensor:
    """The load counters of every MoE layer since the last update: Tensor[n_moe_layers, E]."""
    return torch.stack([layer.tokens_per_expert.detach().clone() for layer in moe_layers(model)])


@torch.no_grad()
def update_expert_bias(model: nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
    """TorchTitan's optimizer-step pre-hook: ``bias += coeff * sign(mean - load)`` (centred), then zero the
    counters. Call it before ``optimizer.step()``. ``process_group``: sum the counters over these ranks first
    (the ranks that see different tokens: data and expert parallel). Unlike TorchTitan, no halving for
    activation checkpointing: recomputation is not counted. Layers without ``load_balance_coeff`` only reset.
    """
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no MoE layers (call prefixflow.moe.apply_moe first)")
    counts = torch.stack([layer.tokens_per_expert for layer in layers]).float()
    if process_group is not None:
        dist.all_reduce(counts, group=process_group)
    for layer, load in zip(layers, counts, strict=True):
        if layer.load_balance_coeff is not None:
            delta = layer.load_balance_coeff * torch.sign(load.mean() - load)
            layer.expert_bias.add_(delta - delta.mean())
        layer.tokens_per_expert.zero_()
