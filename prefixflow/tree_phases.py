"""The three phases on a prefix tree (``RolloutTree``); the driver's phase functions call these for a tree.

- Phase A, top-down over the cached nodes (those with children): each node's forward runs once, reading its
  ancestors' cached K/V through detached leaves (positions continue), keeping its own live K/V in its cache
  and scoring the trained tokens it predicts (LM head at those rows only); its log-probs go to the paths
  as detached leaves too.
- Phase B, the leaf rows as microbatches of paths: each reads the concatenation of its ancestors' caches;
  each path's loss joins the log-probs its ancestors scored; the backward accumulates gK/gV and log-prob
  gradients into every ancestor's leaves. Paths without a leaf token to score form their loss from those
  leaves alone.
- Phase C, bottom-up (children before parents): each node's backward runs once, seeded by its leaves'
  accumulated gradients; a checkpointed block recomputes under the same attention as in Phase A.
The baseline trains every path as a full sequence with the same per-path loss (:func:`path_microbatches`).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch

from .attention import AttendWithAncestors, MaskedAttention
from .kv_cache import PrefixKVCache
from .layouts import Microbatch
from .stage import attention_mode, forward_hidden, logprob_objective, loss_logprobs
from .tree_layouts import TreePlan, tree_microbatch

__all__ = ["NodeCaches", "node_forwards", "leaf_microbatches", "node_backwards", "path_microbatches"]


class NodeCaches:
    """Every cached node's K/V cache (:class:`~prefixflow.kv_cache.PrefixKVCache`), the mask and key nodes
    of its Phase-A row, and its scored log-probs (live, and the detached leaf the paths read)."""

    def __init__(self, plan: TreePlan, grad_dtype: torch.dtype | None) -> None:
        self.caches = {j: PrefixKVCache(grad_dtype) for j in plan.cached}
        self.rows: dict[int, tuple[torch.Tensor | None, list[int]]] = {}
        self.live: dict[int, torch.Tensor] = {}
        self.leaf: dict[int, torch.Tensor] = {}

    def reader(self, nodes: list[int]):
        """``read(layer, dtype)``: the K/V leaves of ``nodes`` concatenated along the keys, or None."""

        def read(layer: int, dtype: torch.dtype):
            if not nodes:
                return None
            entries = [self.caches[j].layers[layer] for j in nodes]
            k = torch.cat([e.prefix_k for e in entries], dim=2).to(dtype)
            return k, torch.cat([e.prefix_v for e in entries], dim=2).to(dtype)

        return read

    def shared(self, plan: TreePlan, paths: list[int]) -> tuple | None:
        """The ancestor-scored log-probs of ``paths`` as ``(logprobs, path ids, slots)``, or None."""
        by_node = defaultdict(list)
        for i in paths:
            for node, k, slot in plan.shared[i]:
                by_node[node].append((k, i, slot))
        if not by_node:
            return None
        parts, ids, slots = [], [], []
        for node, entries in by_node.items():
            leaf = self.leaf[node]
            parts.append(leaf[torch.tensor([k for k, _, _ in entries], device=leaf.device)])
            ids += [i for _, i, _ in entries]
            slots += [s for _, _, s in entries]
        device = parts[0].device
        as_long = dict(dtype=torch.long, device=device)
        return torch.cat(parts), torch.tensor(ids, **as_long), torch.tensor(slots, **as_long)

    def drop(self, j: int) -> None:
        self.caches[j].release()
        self.live.pop(j, None)
        self.leaf.pop(j, None)

    def release(self) -> None:
        for j in list(self.caches):
            self.drop(j)


def node_forwards(run, caches: NodeCaches) -> None:
    """Phase A: every cached node's forward once, top-down."""
    plan, tree = run.tree_plan, run.group
    for j in plan.cached:
        mb, keys = tree_microbatch(tree, [plan.node_row(j)], "padded", run.device)
        plan.trunk_tokens += mb.n_tokens
        caches.rows[j] = (mb.mask, keys)
        with attention_mode(run, AttendWithAncestors(caches.reader(keys), mb.mask, capture=caches.caches[j])):
            hidden = forward_hidden(run.model, mb.tokens, mb.positions)
        if mb.targets.numel():
            logp = loss_logprobs(run, mb, hidden)
            caches.live[j] = logp
            caches.leaf[j] = logp.detach().requires_grad_(True)


def leaf_microbatches(run, caches: NodeCaches) -> float:
    """Phase B: the paths' leaf rows in ``run.plan``'s microbatches, then the paths with no leaf row."""
    plan, tree = run.tree_plan, run.group

    def build(chunk):
        mb, keys = tree_microbatch(tree, [plan.leaf_rows[i] for i in chunk], run.layout, run.device)
        plan.trunk_tokens += mb.n_tokens
        mb = dataclasses.replace(mb, shared_logprobs=caches.shared(plan, chunk))
        return mb, AttendWithAncestors(caches.reader(keys), mb.mask)

    total = run.stage.microbatches(run, build)
    rest = plan.leafless
    if rest:
        empty = torch.zeros(0, dtype=torch.long, device=run.device)
        mb = Microbatch(
            empty.view(1, 0), None, None, empty, empty, empty, empty, empty, tuple(rest),
            shared_logprobs=caches.shared(plan, rest),
        )  # fmt: skip
        no_logp = torch.zeros(0, dtype=mb.shared_logprobs[0].dtype, device=run.device)
        value, objective = logprob_objective(run, mb, no_logp)
        objective.backward()
        total += value
    return total


def node_backwards(run, caches: NodeCaches) -> None:
    """Phase C: every cached node's backward once, children before parents; each node's cache and graph
    are dropped right after its backward."""
    for j in reversed(run.tree_plan.cached):
        mask, keys = caches.rows[j]
        leaf = caches.leaf.get(j)
        seeded = leaf is not None and leaf.grad is not None
        roots, grads = ([caches.live[j]], [leaf.grad]) if seeded else ([], [])
        with attention_mode(run, AttendWithAncestors(caches.reader(keys), mask)):
            caches.caches[j].backward_prefix(roots, grads)
        caches.drop(j)


def path_microbatches(run) -> float:
    """The baseline on a tree: every path as one full sequence, in ``run.plan``'s microbatches."""
    plan, tree = run.tree_plan, run.group

    def build(chunk):
        mb, _ = tree_microbatch(tree, [plan.full_row(i) for i in chunk], run.layout, run.device)
        plan.trunk_tokens += mb.n_tokens
        return mb, MaskedAttention(mb.mask) if mb.mask is not None else None

    return run.stage.microbatches(run, build)


def tree_counts(run) -> tuple[int, int, int, int]:
    """``(n_microbatches, prefix_tokens, suffix_tokens, trunk_tokens)`` of a tree's ``GroupStats``: cached
    node tokens (each once), trained tokens summed over the paths, token slots run (pads included)."""
    plan, tree = run.tree_plan, run.group
    n_mb = len(run.plan.chunks)
    prefix = 0
    if run.system != "baseline":
        prefix = plan.prefix_tokens
        n_mb += bool(plan.leafless)  # their one objective-only microbatch
    return n_mb, prefix, sum(int(m.sum()) for m in tree.loss_masks), plan.trunk_tokens
