"""``record_routing``: the recording pass that produces a group's routing masks (what a rollout engine
records for Rollout Routing Replay), with the prefix routed once for the whole group."""

from __future__ import annotations

import torch
from torch import nn

from ..adapters import adapter_for
from ..apply import runtime_of
from ..attention import AttendWithPrefix, CapturePrefix
from ..group import RoutingMasks
from ..kv_cache import PrefixKVCache
from ..layouts import build_microbatch, suffix_segments
from .layers import RoutePlan
from .schedule_hooks import moe_layers

__all__ = ["record_routing"]


@torch.no_grad()
def record_routing(model: nn.Module, group, *, microbatch: int | None = None) -> RoutingMasks:
    """Route ``group`` live, without gradients, and return its :class:`RoutingMasks`.

    The prefix ``P[:-1]`` runs once and leaves its K/V in a cache; the suffixes ``[P[-1], S_i[:-1]]`` run
    packed, ``microbatch`` responses at a time (None = all), reading it, exactly as PrefixFlow trains them.
    ``P[-1]``'s row of the prefix mask comes from the first response. Needs ``apply_prefixflow(model)``.
    The model's load counters are not touched.
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
    device = next(model.parameters()).device
    group = group.to(device)

    def routed(tokens: torch.Tensor, forward) -> torch.Tensor:
        plans = [RoutePlan(shape=tuple(tokens.shape), record=[]) for _ in layers]
        for layer, plan in zip(layers, plans, strict=True):
            layer.route_plan = plan
        try:
            forward()
        finally:
            for layer in layers:
                layer.route_plan = None
        return torch.stack([plan.record[-1] for plan in plans])  # [n_layers, tokens, k]

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
