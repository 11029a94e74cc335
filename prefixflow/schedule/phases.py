"""The phase functions: every shape (a flat group, a prefix tree, a pipeline stage, a split group's part, a
hybrid or multimodal model) runs these, and only these.

A call runs a tree (a flat group is :func:`~prefixflow.tree.plan.group_tree`: one cached node) in *waves*,
one per Phase-B microbatch, depth-first:

- Phase A, :func:`node_forwards`: the wave's cached nodes that it reads first, top-down, each forward once.
  A node reads its ancestors' cached K/V the way a leaf does, and its cache captures its own live K/V; it
  scores the trained tokens it predicts (its children's first tokens included). A node that scores nothing
  stops after its last layer's K/V (the rest of its forward is dead work).
- Phase B, :func:`leaf_microbatches`: the wave's leaf rows as one microbatch (padded or packed), reading
  every ancestor's cached K/V; their backward accumulates gK/gV into the ancestors' leaves. Then the paths
  with no leaf row, whose loss reads cached nodes' scores alone.
- Phase C, :func:`node_backwards`: the cached nodes no later path reads, children before parents, each one
  backward seeded by its accumulated gradients (the one call of ``backward_prefix``); a checkpointed block
  recomputes under the same attention as in Phase A.

The baseline trains every path as one full sequence (:func:`path_microbatches`). Where the model runs is the
runtime's :class:`~prefixflow.schedule.stage.Stage`; parallelism and MoE enter through the hooks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from ..attention.modes import MaskedAttention, NodeAttention, PrefixCaptured
from ..memory.offload import offloading
from ..tree.layouts import Microbatch, Row, lay_out
from .caches import NodeCaches
from .run import GroupRun
from .stage import attention_mode, logprob_objective, loss_logprobs

__all__ = ["Wave", "waves", "node_forwards", "leaf_microbatches", "node_backwards", "path_microbatches"]


class Wave:
    """One wave: ``forward`` (the cached nodes its first microbatch reads first, top-down); ``chunks``
    (``(index in the chunks, paths)``, lazy: Phase B pulls them, and the wave takes the next chunk while it
    reads no new node and no node is finished); ``leafless`` (paths with no leaf row whose objective runs
    after the chunks); after Phase B, ``backward`` (the cached nodes no later path reads, children first)."""

    def __init__(self, state: _Waves, first: tuple[int, list[int]] | None, forward: list[int]) -> None:
        self.state, self.first, self.forward = state, first, forward
        self.leafless: list[int] = []
        self.backward: list[int] = []

    @property
    def chunks(self):
        if self.first is not None:
            yield self.first
            while (nxt := self.state.extend()) is not None:
                yield nxt
        self.state.close()  # the wave's chunks are known: so are the nodes it finishes


class _Waves:
    """The state of a call's waves (see :func:`waves`): which cached nodes are live or finished, how many
    paths each still has to run, and the leafless paths not run yet."""

    def __init__(self, run: GroupRun) -> None:
        rows, tree = run.rows, run.tree
        cached = set(rows.cached)
        self.top_down = {j: k for k, j in enumerate(rows.cached)}
        self.nodes_of = {i: [j for j in tree.path_nodes(i) if j in cached] for i in range(tree.n)}
        mine = run.paths  # a split group's part reads its node for its own paths only
        through = rows.count_through(mine)
        self.readers = {j: through[j] for j in rows.cached}  # this rank's paths not run yet, per cached node
        # a share that computes the prefix for other ranks (a split group's owner) runs every cached node's
        # forward and backward, even one that none of its own paths reads: the first wave takes them
        self.unread = [j for j in rows.cached if self.readers[j] == 0] if run.computes_prefix else []
        self.position = {i: k for k, i in enumerate(rows.dfs_paths)}
        self.leafless = [i for i in rows.leafless if i in mine]  # depth-first order, not run yet
        self.live: set[int] = set()
        self.finished: set[int] = set()
        self.chunks = iter(enumerate(run.chunks))
        self.pending: tuple[int, list[int]] | None = None
        self.wave: Wave | None = None

    def _joiners(self, paths: list[int]) -> list[int]:
        """The leafless paths depth-first before the last of ``paths``: they run in the same wave."""
        last = max(self.position[i] for i in paths)
        return [i for i in self.leafless if self.position[i] < last]

    def _need(self, paths: list[int]) -> set[int]:
        return {j for i in paths for j in self.nodes_of[i]} - self.live - self.finished

    def _done(self) -> list[int]:
        return sorted((j for j in self.live if self.readers[j] == 0), key=self.top_down.get, reverse=True)

    def _take(self, paths: list[int]) -> None:
        joiners = self._joiners(paths) if paths else list(self.leafless)
        self.leafless = [i for i in self.leafless if i not in joiners]
        self.wave.leafless += joiners
        for i in [*paths, *joiners]:
            for j in self.nodes_of[i]:
                self.readers[j] -= 1

    def start(self, first: tuple[int, list[int]] | None) -> Wave:
        paths = [] if first is None else first[1]
        need = self._need([*paths, *(self._joiners(paths) if paths else self.leafless)]) | set(self.unread)
        self.unread = []
        self.live.update(need)
        self.wave = Wave(self, first, sorted(need, key=self.top_down.get))
        self._take(paths)
        return self.wave

    def extend(self) -> tuple[int, list[int]] | None:
        """The wave's next chunk, or None: a node is finished (its backward is due), the next chunk reads a
        node not live yet (it starts the next wave), or none is left."""
        if self._done():
            return None
        nxt = next(self.chunks, None)
        if nxt is None:
            return None
        if self._need([*nxt[1], *self._joiners(nxt[1])]):
            self.pending = nxt
            return None
        self._take(nxt[1])
        return nxt

    def close(self) -> None:
        self.wave.backward = self._done()
        self.live.difference_update(self.wave.backward)
        self.finished.update(self.wave.backward)


def waves(run: GroupRun):
    """The waves of a PrefixFlow call: each begins with a Phase-B microbatch and forwards just before it the
    cached nodes it reads first; it takes the following microbatches while they read no new node and no node
    is finished; its Phase C runs the backward of the nodes no later path reads right after them. A flat group
    is one wave (its one node is read by every microbatch). Lazy: ``run.chunks`` (``microbatch="auto"`` sizes
    each microbatch after the ones before it ran) gives the next chunk when the previous one ran. A path with
    no leaf row joins the wave whose microbatch reaches past it in depth-first order."""
    state = _Waves(run)
    ran = False
    while (first := state.pending or next(state.chunks, None)) is not None:
        state.pending = None
        ran = True
        yield state.start(first)
    if state.leafless or not ran:
        yield state.start(None)


def _microbatch(run: GroupRun, rows: list[Row], layout: str) -> tuple[Microbatch, list[int]]:
    """``rows`` laid out (their token slots counted), the part this rank computes (``ScheduleHooks.shard``),
    and the cached nodes they read."""
    keys = run.rows.key_nodes(rows)
    mb = lay_out(rows, keys, [run.tree.node_len(j) for j in range(run.tree.n_nodes)], layout, run.device)
    if run.masks is not None:  # sliding windows, bidirectional blocks (prefixflow.tree.masks)
        mb = run.masks.apply(mb, keys, run.tree)
    run.counters.trunk_tokens += mb.n_tokens
    return run.hooks.shard(mb), keys


def _attention(run: GroupRun, caches: NodeCaches, mb: Microbatch, keys: list[int], **kw) -> NodeAttention:
    return NodeAttention(
        caches.keys(keys), mb.mask, rows=mb.rows, sequence=mb.sequence,
        variant=run.runtime.config.attention_for(run.device), causal_own=mb.causal_suffix,
        keys_visible=mb.keys_visible, layer_masks=mb.layer_masks, **kw,
    )  # fmt: skip


def _stop_after(run: GroupRun, j: int) -> int | None:
    """The layer after whose K/V node ``j``'s forward may stop, or None to run it whole: it scores nothing
    here, this stage holds the model's last layers, and nothing else reads the rest. A checkpointed last
    block runs to its end (its recomputation in Phase C must save what its forward saved), and so does every
    block when a schedule hook reads prefix work past the last K/V."""
    adapter = run.runtime.adapter
    if run.rows.scores(j) or not run.stage.holds_loss or run.hooks.full_prefix_forward():
        return None
    if adapter.block_is_checkpointed(adapter.blocks(run.model)[-1]):
        return None
    return run.runtime.n_wrapped - 1


def node_forwards(run: GroupRun, caches: NodeCaches, wave: Wave) -> None:
    """Phase A: the wave's cached nodes' forwards, top-down (their part on this rank, under CP). Loss terms
    the hooks add during a node's forward (``extra_loss``, e.g. an MoE balance loss) join its Phase C."""
    for j in wave.forward:
        mb, keys = _microbatch(run, [run.rows.node_rows[j]], "padded")
        caches.rows[j] = (mb, keys)
        mode = _attention(run, caches, mb, keys, capture=caches[j], stop_after=_stop_after(run, j))
        with _node_clock(run, j, "A"):
            with attention_mode(run, mode), run.hooks.microbatch(mb), offloading(caches.offloads.get(j)):
                try:
                    hidden = run.stage.node_forward(run, j, mb)
                except PrefixCaptured:
                    hidden = None  # the last layer's K/V are in the cache; the rest is dead work
            if hidden is not None and run.rows.scores(j):  # the same LM-head calls on every rank
                caches.score(j, mb, loss_logprobs(run, mb, hidden))
            caches[j].add_prefix_loss(run.hooks.extra_loss())
        caches.note_live()


def leaf_microbatches(run: GroupRun, caches: NodeCaches, wave: Wave) -> float:
    """Phase B: the wave's microbatch of leaf rows, then its paths with no leaf row; returns their loss."""

    def build(chunk):
        mb, keys = _microbatch(run, [run.rows.leaf_rows[i] for i in chunk], run.layout)
        mb = dataclasses.replace(mb, shared_logprobs=caches.shared(chunk))
        return mb, _attention(run, caches, mb, keys)

    total = run.stage.microbatches(run, build, wave.chunks)
    shared = caches.shared(wave.leafless) if wave.leafless else None
    run.counters.leafless_units += bool(wave.leafless)
    if shared is not None:  # None: this rank holds none of their scores (CP; a pipeline's earlier stages)
        empty = torch.zeros(0, dtype=torch.long, device=run.device)
        mb = Microbatch(
            empty.view(1, 0), None, None, empty, empty, empty, empty, empty, tuple(wave.leafless),
            shared_logprobs=shared,
        )  # fmt: skip
        logp = torch.zeros(0, dtype=shared[0].dtype, device=run.device)
        if run.scores is not None:
            run.scores.add(shared[1], shared[2], shared[0].detach())
        else:
            value, objective = logprob_objective(run, mb, logp)
            objective.backward()
            total += value
    return total


def node_backwards(run: GroupRun, caches: NodeCaches, wave: Wave) -> None:
    """Phase C: the wave's cached nodes' backwards, children before parents, each seeded by its scores'
    gradients, its accumulated gK/gV and the stage's seeds; each node's cache and graph are dropped right
    after its backward."""
    for j in wave.backward:
        mb, keys = caches.rows[j]
        roots, grads = caches.seeds(j)
        recompute = _attention(run, caches, mb, keys)
        if j in caches.offloads:
            caches.offloads[j].prefetch()
        with _node_clock(run, j, "C"):
            stage_roots, stage_grads = run.stage.node_seeds(run, j)
            with attention_mode(run, recompute), run.hooks.prefix_backward(), run.hooks.microbatch(mb):
                caches[j].backward_prefix(roots + stage_roots, grads + stage_grads)
            run.stage.node_backward_done(run, j)
        caches.drop(j)


def path_microbatches(run: GroupRun) -> float:
    """The baseline: every path as one full sequence, in ``run.chunks``' microbatches."""

    def build(chunk):
        mb, _ = _microbatch(run, [run.rows.full_row(i) for i in chunk], run.layout)
        return mb, MaskedAttention(mb.mask, mb.sequence, mb.layer_masks) if mb.mask is not None else None

    return run.stage.microbatches(run, build)


@contextlib.contextmanager
def _node_clock(run: GroupRun, j: int, phase: str):
    """Time one node's Phase-A forward or Phase-C backward into ``run.counters.node_times``."""
    cuda = run.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(run.device)
    start = time.perf_counter()
    try:
        yield
    finally:
        if cuda:
            torch.cuda.synchronize(run.device)
        run.counters.node_times.setdefault(j, {})[phase] = time.perf_counter() - start
