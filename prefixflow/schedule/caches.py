"""The caches of one call's cached nodes (:class:`NodeCaches`) and the cached K/V one microbatch reads
(:class:`CachedKeys`)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch

from ..memory.offload import OffloadStats, PrefixOffload
from ..state.kv_cache import PrefixKVCache
from ..tree.layouts import Microbatch
from .run import GroupRun

__all__ = ["CachedKeys", "NodeCaches"]


class CachedKeys:
    """``keys(layer, dtype)``: the K/V of ``caches`` concatenated along the keys, each through its cache's
    :class:`~prefixflow.state.kv_cache.PrefixView` (its own leaves, or gathered from the CP ranks' shards),
    in the dtype the node computed them in (``dtype=None``); None when no cache holds the layer. One cache
    is read in place. ``begin``/``end`` bracket one forward (a view may prefetch the next layer)."""

    def __init__(self, caches: list[PrefixKVCache], nodes: list[int]) -> None:
        self.caches = caches
        self.by_node = dict(zip(nodes, caches, strict=True))
        self.lazy = any(cache.view.lazy for cache in caches)

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return next((c.compute_dtype for c in self.caches if c.compute_dtype is not None), None)

    def begin(self, stop: int | None = None) -> None:
        """Before one forward; ``stop``: the first layer it reads no cached K/V from (None: it reads all)."""
        for cache in self.caches:
            if len(cache):
                cache.view.begin(cache, stop)

    def end(self) -> None:
        for cache in self.caches:
            if len(cache):
                cache.view.end()

    def states(self, layer: int, parents: list[int | None]) -> dict[str, torch.Tensor] | None:
        """A recurrent layer's start state per row (``[rows, ...]``): the end state of the row's parent node
        (its detached leaves, so the gradient accumulates there), zero for a row with no parent; None when no
        row has one. Rows that all start at one node share its state (batch 1: the layer expands it)."""
        if parents and parents[0] is not None and all(p == parents[0] for p in parents):
            return self.by_node[parents[0]].states.read(layer)
        reads = [None if p is None else self.by_node[p].states.read(layer) for p in parents]
        known = [r for r in reads if r is not None]
        if not known:
            return None
        return {
            name: torch.cat(
                [known[0][name].new_zeros(known[0][name].shape) if r is None else r[name] for r in reads]
            )
            for name in known[0]
        }

    def __call__(self, layer: int, dtype: torch.dtype | None):
        views = [v for cache in self.caches if (v := cache.read(layer, dtype or cache.compute_dtype))]
        if not views:
            return None
        if len(views) == 1:
            return views[0]
        return torch.cat([k for k, _ in views], dim=2), torch.cat([v for _, v in views], dim=2)


class NodeCaches:
    """Every cached node's K/V cache (read through the hooks' view of its ``node_len`` tokens), its offload
    pool (``PrefixFlowConfig.offload``: one per node), the mask, sequence exchange and key nodes of its
    Phase-A row, and its scored log-probs (live, the detached leaf the paths read, and where each of the
    node's scores sits in them: this rank scores only its own tokens when they are spread over ranks, -1
    elsewhere)."""

    def __init__(self, run: GroupRun, *, offload: bool) -> None:
        self.run = run
        grad_dtype = run.runtime.grad_kv_dtype(run.model)
        tree = run.tree
        self.caches = {j: PrefixKVCache(grad_dtype) for j in run.rows.cached}
        for j, cache in self.caches.items():
            cache.view = run.hooks.prefix_view(run.model, tree.node_len(j)) or cache.view
        self.offloads: dict[int, PrefixOffload] = {}
        if offload:
            prefetch, tier = run.runtime.config.offload_prefetch, run.runtime.config.offload_tier
            self.offloads = {
                j: PrefixOffload(run.model, c, prefetch=prefetch, tier=tier) for j, c in self.caches.items()
            }
        self.rows: dict[int, tuple[Microbatch, list[int]]] = {}  # Phase A's row of each node, its key nodes
        self.live: dict[int, torch.Tensor] = {}
        self.leaf: dict[int, torch.Tensor] = {}
        self.local: dict[int, list[int]] = {}

    def __getitem__(self, j: int) -> PrefixKVCache:
        return self.caches[j]

    def note_live(self) -> None:
        """Record the most cached nodes (and their K/V bytes) live at once."""
        live = [c for c in self.caches.values() if len(c)]
        counters = self.run.counters
        counters.peak_live_nodes = max(counters.peak_live_nodes, len(live))
        counters.peak_cache_bytes = max(counters.peak_cache_bytes, sum(c.nbytes() for c in live))

    def keys(self, nodes: list[int]) -> CachedKeys:
        return CachedKeys([self.caches[j] for j in nodes], nodes)

    def score(self, j: int, mb: Microbatch, logp: torch.Tensor) -> None:
        """Keep node ``j``'s log-probs of this rank's scored tokens (``mb.token_ids``: their score index)."""
        self.live[j] = logp
        self.leaf[j] = logp.detach().requires_grad_(logp.requires_grad)
        local = [-1] * self.run.rows.scores(j)
        for at, k in enumerate(mb.token_ids.tolist()):
            local[k] = at
        self.local[j] = local

    def seeds(self, j: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Node ``j``'s scores and their accumulated gradients, the seeds of its backward besides gK/gV.
        Seeded on every rank, zeros where no path read this rank's scores: under CP each rank's backward must
        reach the same sequence exchanges (the last layer's is reached only through the scores)."""
        leaf = self.leaf.get(j)
        if leaf is None:
            return [], []
        return [self.live[j]], [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)]

    def shared(self, paths: list[int]) -> tuple | None:
        """The cached-node-scored log-probs of ``paths`` that this rank holds, as ``(logprobs, path ids,
        slots)``, or None."""
        by_node = defaultdict(list)
        for i in paths:
            for node, k, slot in self.run.rows.shared[i]:
                if node in self.local and (at := self.local[node][k]) >= 0:
                    by_node[node].append((at, i, slot))
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

    def only(self) -> PrefixKVCache | None:
        """The one cached node's cache of a flat group (None for a one-token prompt)."""
        if len(self.caches) > 1:
            raise ValueError("a split rollout group has at most one cached node")
        return next(iter(self.caches.values()), None)

    def drop(self, j: int) -> None:
        self.caches[j].release()  # the node's graph first, then the pool its saved tensors point into
        self.live.pop(j, None)
        self.leaf.pop(j, None)
        if j in self.offloads:
            self.offloads[j].release()

    def offload_stats(self) -> OffloadStats | None:
        """The nodes' offload counters summed (None when offload is off)."""
        if not self.offloads:
            return None
        parts = [o.stats for o in self.offloads.values()]
        if len(parts) == 1:
            return parts[0]
        total = OffloadStats(
            tier=parts[0].tier, prefetch=parts[0].prefetch, released=all(p.released for p in parts)
        )
        for part in parts:
            for f in dataclasses.fields(OffloadStats):
                value = getattr(part, f.name)
                if f.name == "kept":
                    for reason, n in value.items():
                        total.kept[reason] = total.kept.get(reason, 0) + n
                elif isinstance(value, int) and not isinstance(value, bool):
                    setattr(total, f.name, getattr(total, f.name) + value)
        return total

    def release(self) -> None:
        for j in list(self.caches):
            self.drop(j)
