"""``record_routing``: the recording pass that produces a group's routing masks (what a rollout engine
records for Rollout Routing Replay), with the prefix routed once for the whole group; a prefix tree's masks
are one per node."""

from __future__ import annotations

import torch
from torch import nn

from ..attention.modes import AttendWithPrefix, CapturePrefix
from ..group import RoutingMasks
from ..model.adapters import adapter_for
from ..model.apply import runtime_of
from ..state.kv_cache import PrefixKVCache
from ..tree.layouts import build_microbatch, suffix_segments
from ..tree.rollout_tree import RolloutTree
from .layers import RoutePlan
from .schedule_hooks import moe_layers

__all__ = ["record_routing"]


def _routed(layers, tokens: torch.Tensor, forward) -> torch.Tensor:
    """Run ``forward`` with every MoE layer recording its live choice: ``[n_layers, tokens, k]``."""
    plans = [RoutePlan(shape=tuple(tokens.shape), record=[]) for _ in layers]
    for layer, plan in zip(layers, plans, strict=True):
        layer.route_plan = plan
    try:
        forward()
    finally:
        for layer in layers:
            layer.route_plan = None
    return torch.stack([plan.record[-1] for plan in plans])


def _record_tree(model: nn.Module, tree: RolloutTree, layers) -> list[torch.Tensor]:
    """One mask per node: each path's plain forward, once per path that reaches a node not recorded yet."""
    adapter = adapter_for(model)
    device = next(model.parameters()).device
    masks: list[torch.Tensor | None] = [None] * tree.n_nodes
    for i in range(tree.n):
        nodes = tree.path_nodes(i)
        if all(masks[j] is not None for j in nodes):
            continue
        tokens = tree.path_tokens(i).to(device).unsqueeze(0)
        rows = _routed(layers, tokens, lambda t=tokens: adapter.hidden(model, t, None, final_norm=False))
        for j in nodes:
            start = tree.first_position[j]
            if masks[j] is None:
                masks[j] = rows[:, start : start + tree.node_len(j)].cpu()
    return masks


@torch.no_grad()
def record_routing(
    model: nn.Module, group, *, microbatch: int | None = None
) -> RoutingMasks | list[torch.Tensor]:
    """Route ``group`` live, without gradients, and return its :class:`RoutingMasks`.

    The prefix ``P[:-1]`` runs once and leaves its K/V in a cache; the suffixes ``[P[-1], S_i[:-1]]`` run
    packed, ``microbatch`` responses at a time (None = all), reading it, exactly as PrefixFlow trains them.
    ``P[-1]``'s row of the prefix mask comes from the first response. Needs ``apply_prefixflow(model)``.
    The model's load counters are not touched. For a :class:`~prefixflow.RolloutTree` it returns one mask per
    node (``tree.routing``), each node routed in a plain forward of a path through it.
    """
    runtime = runtime_of(model)
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no MoE layers to record (call apply_moe first)")
    if microbatch is not None and (
        isinstance(microbatch, bool) or not isinstance(microbatch, int) or microbatch < 1
    ):
        raise ValueError(f"microbatch must be None (all responses) or an int >= 1, got {microbatch!r}")
    adapter = adapter_for(model)
    group.check_fits(adapter.vocab_size(model), adapter.max_seq_len(model))
    if isinstance(group, RolloutTree):
        return _record_tree(model, group, layers)
    device = next(model.parameters()).device
    group = group.to(device)

    def routed(tokens: torch.Tensor, forward) -> torch.Tensor:
        return _routed(layers, tokens, forward)

    cache = PrefixKVCache()
    try:
        prefix = group.prompt[:-1].unsqueeze(0)
        prefix_rows = None
        if prefix.numel():

            def run_prefix():
                with runtime.state.use(CapturePrefix(cache, None)):
                    adapter.hidden(model, prefix, None, final_norm=False)

            prefix_rows = routed(prefix, run_prefix)
        segments = suffix_segments(group)
        size = group.n if microbatch is None else microbatch
        suffix_rows: list[torch.Tensor] = []
        variant = runtime.config.attention_for(device)
        for start in range(0, group.n, size):
            chunk = segments[start : start + size]
            mb = build_microbatch(group, chunk, "packed", cached_prefix_len=cache.prefix_len, device=device)

            def run_suffixes(mb=mb):
                with runtime.state.use(AttendWithPrefix(cache, mb.mask, variant)):
                    adapter.hidden(model, mb.tokens, mb.positions, final_norm=False)

            rows = routed(mb.tokens, run_suffixes)
            lens = [int(seg.tokens.numel()) for seg in chunk]
            suffix_rows.extend(rows.split(lens, dim=1))
    finally:
        cache.release()
    last = suffix_rows[0][:, :1]
    prefix_mask = last if prefix_rows is None else torch.cat([prefix_rows, last], dim=1)
    return RoutingMasks(prefix_mask.cpu(), [rows[:, 1:].cpu() for rows in suffix_rows])
