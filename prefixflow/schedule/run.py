"""What every phase function reads: :class:`GroupRun` (one resolved ``train_group`` call), the counters the
phases keep (:class:`RunCounters`), and the protocol of a node's cache (:class:`NodeCache`).

This is the lowest layer of the schedule: the phases (:mod:`.phases`), the stage (:mod:`.stage`) and the
driver (:mod:`.driver`) all take a ``GroupRun``; nothing here runs anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from ..loss import LossConfig
from ..memory.budget import BudgetChunks, FixedChunks
from ..runtime import PrefixFlowRuntime
from ..tree.masks import MaskRules
from ..tree.plan import TreeRows
from ..tree.rollout_tree import PathLosses, RolloutTree

__all__ = ["GroupRun", "RunCounters", "NodeCache", "Scores"]


class NodeCache(Protocol):
    """What a cached node keeps from its Phase-A forward to its Phase-C backward (``PrefixKVCache``): each
    layer's live K/V (and recurrent end states), the detached leaves later rows read, and their gradients.

    - ``capture(layer, k, v)``: keep a layer's live K/V (Phase A; a split group's helper stores received ones);
    - ``read(layer, dtype)``: the K/V a row reads (through the cache's view), or None;
    - ``backward_prefix(roots, grads)``: the node's one delayed backward, seeded with the accumulated
      gradients of its leaves plus ``roots``/``grads`` (its scores' gradients; a pipeline stage's output and
      the gradient the next stage sent back). :func:`~prefixflow.schedule.phases.node_backwards` is its only
      caller;
    - ``release()``: drop everything (the node's graph with its live tensors)."""

    def capture(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def read(self, layer: int, dtype: torch.dtype | None): ...

    def backward_prefix(self, extra_roots=(), extra_grads=()) -> None: ...

    def release(self) -> None: ...


@dataclass
class RunCounters:
    """What the phases count while one call runs (``GroupStats``): token slots run (pads included), cached
    nodes' Phase-A/C seconds, objective-only microbatches (paths with no leaf row), the most cached nodes live
    at once and their K/V bytes."""

    trunk_tokens: int = 0
    node_times: dict[int, dict[str, float]] = field(default_factory=dict)
    leafless_units: int = 0
    peak_live_nodes: int = 0
    peak_cache_bytes: int = 0


class Scores:
    """Forward-only calls (:func:`~prefixflow.schedule.driver.score_group`): where the microbatches' log-probs
    go instead of a loss, as ``logprobs[path]`` over its trained tokens (by loss slot)."""

    def __init__(self, lengths: list[int]) -> None:
        self.logprobs = [None] * len(lengths)
        self.lengths = lengths

    def add(self, paths: torch.Tensor, slots: torch.Tensor, logp: torch.Tensor) -> None:
        for i in paths.unique().tolist():
            if self.logprobs[i] is None:
                self.logprobs[i] = logp.new_zeros(self.lengths[i])
            at = paths == i
            self.logprobs[i][slots[at]] = logp[at]


@dataclass
class GroupRun:
    """One ``train_group`` call, resolved: what the phase functions read.

    ``tree``: what runs, on the model's device (a flat group's :func:`~prefixflow.tree.plan.group_tree`);
    ``rows``: its rows and scores (built from the host copy); ``stage``: where the phases run (a
    :class:`~prefixflow.schedule.stage.Stage`); ``hooks``: the call's schedule hooks (a
    :class:`~prefixflow.hooks.HookChain`); ``paths``: the paths this rank trains (its share's: a split
    group's part holds some); ``computes_prefix``: this rank runs the cached nodes (a split group's helper
    receives them), each once even if none of ``paths`` reads it; ``chunks``: this rank's Phase-B
    microbatches (path indices); ``loss_data``: what the loss reads per path; ``caches``: the cached nodes'
    caches while PrefixFlow runs (a :class:`~prefixflow.schedule.caches.NodeCaches`); ``scores``: set for a
    forward-only call; ``inputs``: a multimodal tree's per-call state from its adapter's ``prepare_inputs``
    (None: token ids only); ``masks``: attention beyond causal (sliding windows, bidirectional blocks) from its
    adapter's ``mask_rules``. (The stage, hooks and caches sit above this module, so they are typed where they
    are defined.)"""

    model: nn.Module
    runtime: PrefixFlowRuntime
    tree: RolloutTree
    rows: TreeRows
    system: str
    layout: str
    loss: str
    cfg: LossConfig
    stage: Any
    hooks: Any
    device: torch.device
    loss_data: PathLosses
    paths: frozenset[int] = frozenset()
    computes_prefix: bool = True
    chunks: FixedChunks | BudgetChunks | None = None
    counters: RunCounters = field(default_factory=RunCounters)
    caches: Any = None
    scores: Scores | None = None
    inputs: Any = None
    masks: MaskRules | None = None
