"""The three phases on a prefix tree (``RolloutTree``); the driver's phase functions call these for a tree.

The driver runs them in *waves* (:func:`waves`), one per Phase-B microbatch of paths in depth-first order:
each wave forwards the cached nodes its paths read that are not live yet, trains its microbatch, and
backwards the nodes no later path reads. Live prefix state is then bounded by the tree's depth (times the
microbatch's span), not by its size; with ``microbatch=None`` one wave holds everything.

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

import contextlib
import dataclasses
import time
from collections import defaultdict

import torch

from ..attention.modes import AttendWithAncestors, MaskedAttention
from ..memory.offload import OffloadStats, PrefixOffload, offloading
from ..state.kv_cache import PrefixKVCache
from ..tree.layouts import Microbatch
from ..tree.plan import TreePlan, tree_microbatch
from .stage import attention_mode, forward_hidden, logprob_objective, loss_logprobs

__all__ = ["NodeCaches", "node_forwards", "leaf_microbatches", "node_backwards", "path_microbatches"]


class AncestorKV:
    """``read(layer, dtype)``: the full K/V of ``nodes`` concatenated along the keys (each through its cache's
    :class:`~prefixflow.state.kv_cache.PrefixView`: its own leaves, or gathered from the CP ranks' shards), or None.
    ``begin``/``end`` bracket one forward (a view may prefetch the next layer)."""

    def __init__(self, caches: list[PrefixKVCache], nodes: list[int]) -> None:
        self.caches = caches
        self.by_node = dict(zip(nodes, caches, strict=True))

    def begin(self) -> None:
        for cache in self.caches:
            cache.view.begin(cache)

    def end(self) -> None:
        for cache in self.caches:
            cache.view.end()

    def states(self, layer: int, parents: list[int | None]) -> dict[str, torch.Tensor] | None:
        """A recurrent layer's start state per row (``[rows, ...]``): the end state of the row's parent node
        (its detached leaves, so the gradient accumulates there), zero for a row with no parent; None when no
        row has one."""
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

    def __call__(self, layer: int, dtype: torch.dtype):
        if not self.caches:
            return None
        views = [cache.read(layer, dtype) for cache in self.caches]
        return torch.cat([k for k, _ in views], dim=2), torch.cat([v for _, v in views], dim=2)


class NodeCaches:
    """Every cached node's K/V cache (:class:`~prefixflow.state.kv_cache.PrefixKVCache`, read through the hooks'
    view of ``node_len`` tokens), the mask, sequence exchange and key nodes of its Phase-A row, and its scored
    log-probs (live, the detached leaf the paths read, and where each of the node's scores sits in them: this
    rank scores only its own tokens when they are spread over ranks, -1 elsewhere)."""

    def __init__(self, run, grad_dtype: torch.dtype | None) -> None:
        self.plan = plan = run.tree_plan
        tree = run.group
        self.caches = {j: PrefixKVCache(grad_dtype) for j in plan.cached}
        for j, cache in self.caches.items():
            cache.view = run.hooks.prefix_view(run.model, tree.node_len(j)) or cache.view
        self.offloads: dict[int, PrefixOffload] = {}  # PrefixFlowConfig.offload: one pool per node
        if run.runtime.config.offload:
            prefetch = run.runtime.config.offload_prefetch
            self.offloads = {
                j: PrefixOffload(run.model, c, prefetch=prefetch) for j, c in self.caches.items()
            }
        self.rows: dict[int, tuple[Microbatch, list[int]]] = {}  # Phase A's row of each node, its key nodes
        self.live: dict[int, torch.Tensor] = {}
        self.leaf: dict[int, torch.Tensor] = {}
        self.local: dict[int, list[int]] = {}

    def note_live(self) -> None:
        """Record the most cached nodes (and their K/V bytes) live at once."""
        live = [c for c in self.caches.values() if len(c)]
        self.plan.peak_live_nodes = max(self.plan.peak_live_nodes, len(live))
        self.plan.peak_cache_bytes = max(self.plan.peak_cache_bytes, sum(c.nbytes() for c in live))

    def reader(self, nodes: list[int]) -> AncestorKV:
        return AncestorKV([self.caches[j] for j in nodes], nodes)

    def score(self, j: int, mb: Microbatch, logp: torch.Tensor) -> None:
        """Keep node ``j``'s log-probs of this rank's scored tokens (``mb.token_ids``: their score index)."""
        self.live[j] = logp
        self.leaf[j] = logp.detach().requires_grad_(True)
        local = [-1] * len(self.plan.scores[j][0])
        for at, k in enumerate(mb.token_ids.tolist()):
            local[k] = at
        self.local[j] = local

    def shared(self, plan: TreePlan, paths: list[int]) -> tuple | None:
        """The ancestor-scored log-probs of ``paths`` that this rank holds, as ``(logprobs, path ids, slots)``,
        or None."""
        by_node = defaultdict(list)
        for i in paths:
            for node, k, slot in plan.shared[i]:
                if (at := self.local[node][k]) >= 0:
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


@dataclasses.dataclass
class TreeWave:
    """One wave: ``forward`` (cached nodes, top-down), ``chunks`` (``(plan index, paths)`` Phase-B
    microbatches), ``leafless`` (paths with no leaf row whose objective runs now), ``backward`` (cached
    nodes, children first)."""

    forward: list[int]
    chunks: list[tuple[int, list[int]]]
    leafless: list[int]
    backward: list[int]


def waves(run):
    """The waves of a tree's PrefixFlow call. Lazy: ``run.plan`` (a ``microbatch="auto"`` plan sizes each
    microbatch after the ones before it ran) gives the next chunk when the previous wave is done. A path with
    no leaf row joins the first wave whose microbatch reaches past it in depth-first order."""
    plan, tree = run.tree_plan, run.group
    cached = set(plan.cached)
    top_down = {j: k for k, j in enumerate(plan.cached)}
    nodes_of = {i: [j for j in tree.path_nodes(i) if j in cached] for i in range(tree.n)}
    readers = {j: plan.paths_through[j] for j in plan.cached}  # paths not run yet, per cached node
    position = {i: k for k, i in enumerate(plan.dfs_paths)}
    leafless = list(plan.leafless)  # depth-first order
    live: set[int] = set()
    finished: set[int] = set()

    def wave(chunks, paths):
        need = {j for i in paths for j in nodes_of[i]} - live - finished
        live.update(need)
        for i in paths:
            for j in nodes_of[i]:
                readers[j] -= 1
        done = sorted((j for j in live if readers[j] == 0), key=top_down.get, reverse=True)
        live.difference_update(done)
        finished.update(done)
        lone = [i for i in paths if i not in plan.leaf_rows]
        return TreeWave(sorted(need, key=top_down.get), chunks, lone, done)

    ran = False
    for index, chunk in enumerate(run.plan):
        last = max(position[i] for i in chunk)
        lone = []
        while leafless and position[leafless[0]] < last:
            lone.append(leafless.pop(0))
        ran = True
        yield wave([(index, chunk)], [*chunk, *lone])
    if leafless or not ran:
        yield wave([], leafless)


def node_forwards(run, caches: NodeCaches, wave: TreeWave) -> None:
    """Phase A: the wave's cached nodes' forwards, top-down (their part on this rank, under CP)."""
    plan, tree = run.tree_plan, run.group
    for j in wave.forward:
        mb, keys = tree_microbatch(tree, [plan.node_row(j)], "padded", run.device)
        plan.trunk_tokens += mb.n_tokens
        mb = run.hooks.shard(mb)
        caches.rows[j] = (mb, keys)
        mode = AttendWithAncestors(
            caches.reader(keys), mb.mask, capture=caches.caches[j], sequence=mb.sequence, rows=mb.tree_rows
        )
        with _node_clock(run, j, "A"):
            with attention_mode(run, mode), run.hooks.microbatch(mb), offloading(caches.offloads.get(j)):
                hidden = forward_hidden(run.model, mb.tokens, mb.positions)
            if plan.scores[j][0]:  # the node scores tokens (on some rank): the same LM-head calls everywhere
                caches.score(j, mb, loss_logprobs(run, mb, hidden))
            caches.caches[j].add_prefix_loss(run.hooks.extra_loss())  # e.g. MoE balance: joins its Phase C
        caches.note_live()


def leaf_microbatches(run, caches: NodeCaches, wave: TreeWave) -> float:
    """Phase B: the wave's microbatch of leaf rows, then its paths with no leaf row."""
    plan, tree = run.tree_plan, run.group

    def build(chunk):
        mb, keys = tree_microbatch(tree, [plan.leaf_rows[i] for i in chunk], run.layout, run.device)
        plan.trunk_tokens += mb.n_tokens
        mb = dataclasses.replace(run.hooks.shard(mb), shared_logprobs=caches.shared(plan, chunk))
        return mb, AttendWithAncestors(caches.reader(keys), mb.mask, sequence=mb.sequence, rows=mb.tree_rows)

    total = run.stage.microbatches(run, build, wave.chunks)
    rest = wave.leafless
    shared = caches.shared(plan, rest) if rest else None
    plan.leafless_units += bool(rest)
    if shared is not None:  # None: this rank holds none of their scores (CP)
        empty = torch.zeros(0, dtype=torch.long, device=run.device)
        mb = Microbatch(
            empty.view(1, 0), None, None, empty, empty, empty, empty, empty, tuple(rest),
            shared_logprobs=shared,
        )  # fmt: skip
        no_logp = torch.zeros(0, dtype=mb.shared_logprobs[0].dtype, device=run.device)
        value, objective = logprob_objective(run, mb, no_logp)
        objective.backward()
        total += value
    return total


def node_backwards(run, caches: NodeCaches, wave: TreeWave) -> None:
    """Phase C: the wave's cached nodes' backwards, children before parents; each node's cache and graph
    are dropped right after its backward."""
    for j in wave.backward:
        mb, keys = caches.rows[j]
        roots, grads = [], []
        if (leaf := caches.leaf.get(j)) is not None:
            # Seeded on every rank, zeros where no path read this rank's scores: under CP each rank's backward
            # must reach the same sequence exchanges (the last layer's is reached only through the scores).
            roots.append(caches.live[j])
            grads.append(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
        recompute = AttendWithAncestors(caches.reader(keys), mb.mask, sequence=mb.sequence, rows=mb.tree_rows)
        if j in caches.offloads:
            caches.offloads[j].prefetch()
        with _node_clock(run, j, "C"), attention_mode(run, recompute), run.hooks.prefix_backward():
            with run.hooks.microbatch(mb):  # a checkpointed block recomputes under the node's route plan
                caches.caches[j].backward_prefix(roots, grads)
        caches.drop(j)


def path_microbatches(run) -> float:
    """The baseline on a tree: every path as one full sequence, in ``run.plan``'s microbatches."""
    plan, tree = run.tree_plan, run.group

    def build(chunk):
        mb, _ = tree_microbatch(tree, [plan.full_row(i) for i in chunk], run.layout, run.device)
        plan.trunk_tokens += mb.n_tokens
        mb = run.hooks.shard(mb)
        return mb, MaskedAttention(mb.mask, mb.sequence) if mb.mask is not None else None

    return run.stage.microbatches(run, build)


@contextlib.contextmanager
def _node_clock(run, j: int, phase: str):
    """Time one node's Phase-A forward or Phase-C backward into ``run.tree_plan.node_times``."""
    cuda = run.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(run.device)
    start = time.perf_counter()
    try:
        yield
    finally:
        if cuda:
            torch.cuda.synchronize(run.device)
        run.tree_plan.node_times.setdefault(j, {})[phase] = time.perf_counter() - start


def tree_summary(run) -> dict:
    """``GroupStats.tree``: nodes, cached nodes, the trie's unique tokens, and each cached node's Phase-A and
    Phase-C seconds (``node_times``, by node index)."""
    plan, tree = run.tree_plan, run.group
    return {
        "nodes": len(tree.segments),
        "cached_nodes": len(plan.cached),
        "unique_tokens": tree.unique_tokens,
        "node_times": {j: dict(t) for j, t in plan.node_times.items()},
        "peak_live_nodes": plan.peak_live_nodes,
        "peak_cache_bytes": plan.peak_cache_bytes,
    }


def tree_counts(run) -> tuple[int, int, int, int]:
    """``(n_microbatches, prefix_tokens, suffix_tokens, trunk_tokens)`` of a tree's ``GroupStats``: cached
    node tokens (each once), trained tokens summed over the paths, token slots run (pads included)."""
    plan, tree = run.tree_plan, run.group
    n_mb = len(run.plan.chunks)
    prefix = 0
    if run.system != "baseline":
        prefix = plan.prefix_tokens
        n_mb += plan.leafless_units  # objective-only microbatches of the paths with no leaf row
    return n_mb, prefix, sum(int(m.sum()) for m in tree.loss_masks), plan.trunk_tokens
