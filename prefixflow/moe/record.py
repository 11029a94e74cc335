"""``record_routing``: the recording pass that produces a group's routing masks (what a rollout engine
records for Rollout Routing Replay), through PrefixFlow's own phases, forward only: every cached node (a flat
group's prefix) is routed once, each leaf in its row, exactly as PrefixFlow trains them. A prefix tree's
masks are one per node."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..group import RolloutGroup, RoutingMasks
from ..hooks import ScheduleHooks
from ..model.adapters import adapter_for
from ..model.apply import runtime_of
from ..schedule.driver import score_group
from ..tree.plan import group_tree
from ..tree.rollout_tree import RolloutTree
from .layers import RoutePlan
from .schedule_hooks import moe_layers

__all__ = ["record_routing"]


class _RouteRecorder(ScheduleHooks):
    """Every MoE layer records its live choice in every microbatch; ``routed[node]``: ``[n_layers, tokens,
    k]`` of the tokens of that node a row fed (a cached node's row: all of them; a leaf row: all but the last)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = layers
        self.routed: dict[int, torch.Tensor] = {}

    def full_prefix_forward(self) -> bool:
        return True  # every layer routes every cached token

    @contextlib.contextmanager
    def microbatch(self, mb):
        plans = [RoutePlan(shape=tuple(mb.tokens.shape), record=[]) for _ in self.layers]
        for layer, plan in zip(self.layers, plans, strict=True):
            layer.route_plan = plan
        try:
            yield
        finally:
            for layer in self.layers:
                layer.route_plan = None
        routed = torch.stack([plan.record[-1] for plan in plans])  # [n_layers, b * L, k]
        rows, width = mb.tokens.shape
        lengths = [len(r) for r in mb.rows]
        if rows == len(lengths) and rows > 1:  # padded: one row per sequence
            pieces = [routed.view(len(self.layers), rows, width, -1)[:, b, :n] for b, n in enumerate(lengths)]
        else:
            pieces = list(routed.split(lengths, dim=1))
        for row, piece in zip(mb.rows, pieces, strict=True):
            self.routed[row.nodes[-1]] = piece.cpu()


def record_routing(
    model: nn.Module, group: RolloutGroup | RolloutTree, *, microbatch: int | None = None
) -> RoutingMasks | list[torch.Tensor]:
    """Route ``group`` live, without gradients, and return its :class:`RoutingMasks` (a tree: one mask per
    node, ``tree.routing``).

    The cached prefix ``P[:-1]`` (a tree: each cached node) runs once and leaves its K/V in its cache; the
    leaf rows ``[P[-1], S_i[:-1]]`` run packed, ``microbatch`` responses at a time (None = all), reading it,
    exactly as PrefixFlow trains them (:func:`~prefixflow.schedule.driver.score_group`). ``P[-1]``'s row of
    the prefix mask comes from the first response. A leaf's last token is never fed to the model: its row
    repeats the one before it. Needs ``apply_prefixflow(model)``. The model's load counters are not touched.
    """
    runtime_of(model)
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no MoE layers to record (call apply_moe first)")
    if microbatch is not None and (
        isinstance(microbatch, bool) or not isinstance(microbatch, int) or microbatch < 1
    ):
        raise ValueError(f"microbatch must be None (all responses) or an int >= 1, got {microbatch!r}")
    adapter = adapter_for(model)
    group.check_fits(adapter.vocab_size(model), adapter.max_seq_len(model))
    tree = group_tree(group) if isinstance(group, RolloutGroup) else group
    # Every token after each root's first is routed in some row: train them all (the loss is not read).
    trained = [torch.ones(n, dtype=torch.bool) for n in tree.path_lens]
    for mask in trained:
        mask[0] = False
    probe = RolloutTree(tree.segments, tree.parents, tree.path_ends, torch.zeros(tree.n), trained)
    recorder = _RouteRecorder(layers)
    score_group(model, probe, layout="packed", microbatch=microbatch, hooks=[recorder])
    masks = []
    for j in range(tree.n_nodes):
        if tree.children[j]:
            masks.append(recorder.routed[j])
            continue
        fed = recorder.routed.get(j)
        if fed is None:  # a one-token leaf: its token is fed nowhere
            parent = recorder.routed[tree.parents[j]]
            fed = parent[:, parent.shape[1] :]
        masks.append(torch.cat([fed, (fed if fed.shape[1] else parent)[:, -1:]], dim=1))
    if isinstance(group, RolloutTree):
        return masks
    if group.prompt_len > 1:
        leaves = masks[1:]
        prefix = torch.cat([masks[0], leaves[0][:, :1]], dim=1)
    else:
        leaves = masks
        prefix = leaves[0][:, :1]
    return RoutingMasks(prefix, [leaf[:, 1:n] for leaf, n in zip(leaves, group.response_lens, strict=True)])
