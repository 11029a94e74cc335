"""Context parallelism (paper §4.5): the CP schedule hook and PrefixFlow's prefix K/V exchange.

Sequence sharding and the K/V exchange inside attention, which both systems share, are in
:mod:`prefixflow.parallel.sequence`. On top of it, PrefixFlow's prefix:

- Phase A shards the prefix like any sequence, so each rank captures its own (balanced) K/V shard.
- Before a layer's suffix attention, :class:`CPPrefixView` all-gathers the shards into the full view; the
  suffix backward reduce-scatters the view's gK/gV into the owners' accumulators (the cache's leaves), which
  Phase C injects as usual. With ``prefetch`` the gather of layer ``l+1`` is issued asynchronously as soon as
  layer ``l`` has its view, so it overlaps layer ``l``'s compute; only each microbatch's first layer gathers on
  demand.

:class:`ContextParallel` is the schedule hook that does all of this (``apply_cp``); it also all-reduces the
new parameter gradients over the CP group after each group and sums the reported loss.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn

from ..hooks import ScheduleHooks, add_hooks
from ..model.compile import is_compiled
from ..schedule.host import on_host
from ..state.kv_cache import PrefixKVCache, PrefixView
from ..tree.layouts import Microbatch
from .sequence import Blocked, Collectives, CommStats, SequenceLayout, _wide, _wire, shard_microbatch

__all__ = [
    "CPPrefixView",
    "CommStats",
    "Collectives",
    "ContextParallel",
    "apply_cp",
]


class _PrefixGather:
    """One in-flight all-gather of a layer's prefix K/V shards; ``done`` is set when the data has arrived."""

    def __init__(self, view: CPPrefixView, cache: PrefixKVCache, layer: int, dtype: torch.dtype) -> None:
        entry = cache.layers[layer]
        local = torch.stack([entry.prefix_k.detach(), entry.prefix_v.detach()]).to(dtype).contiguous()
        self.out = local.new_empty((view.layout.size, *local.shape))  # [cp, 2, 1, H, l, D]
        self.issued = time.perf_counter()
        self.done: float | None = None
        self.work = view.collectives.all_gather(self.out, local, view.process_group, async_op=True)
        fut = self.work.get_future() if hasattr(self.work, "get_future") else None
        if fut is not None:
            fut.then(self._arrived)

    def _arrived(self, _fut) -> None:
        self.done = time.perf_counter()

    def wait(self, stats: CommStats, names: tuple[str, ...], prefetched: bool) -> None:
        """Block until the data is here, counting the wait in ``names`` (and the overlap, when prefetched)."""
        blocked = Blocked(self.out.device)
        self.work.wait()
        if self.done is None:
            self.done = time.perf_counter()
        blocked.stop(stats, names, (self.done - self.issued) if prefetched else None)


class _PrefixViewFn(torch.autograd.Function):
    """The gathered full prefix view of one layer, differentiable w.r.t. this rank's leaves: the backward
    reduce-scatters the view's gK/gV to the owners."""

    @staticmethod
    def forward(ctx, leaf_k, leaf_v, gathered, view: CPPrefixView):
        ctx.view, ctx.leaf_dtype = view, leaf_k.dtype
        size, local_len = view.layout.size, view.layout.local_len
        _, order = view.layout.on(gathered.device)
        _, two, one, h, _, d = gathered.shape
        whole = gathered.permute(1, 2, 3, 0, 4, 5).reshape(two, one, h, size * local_len, d)
        return whole[0].index_select(2, order), whole[1].index_select(2, order)

    @staticmethod
    def backward(ctx, grad_k, grad_v):
        view = ctx.view
        gk, gv = view.scatter_back(grad_k, grad_v, ctx.leaf_dtype)
        return gk, gv, None, None


def _in_op_sac() -> bool:
    """Whether an op-level SAC region (``create_selective_checkpoint_contexts``) is recording. It replays a
    block's ops by their order in the block; a gather issued for the next layer inside this block would be an
    op its recompute never runs (and the recompute's own demand gather one its forward never ran), so under
    SAC every layer gathers its own view on demand."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    from torch.utils.checkpoint import _CachingTorchDispatchMode

    return any(isinstance(m, _CachingTorchDispatchMode) for m in _get_current_dispatch_mode_stack())


class CPPrefixView(PrefixView):
    """The full prefix K/V view of each layer, all-gathered from the CP group's shards (paper §4.5).

    Lazy: each layer reads its view when its suffix attention runs. Without ``prefetch`` every read is a
    demand gather (issue and wait). With it, reading layer ``l`` issues layer ``l+1``'s gather asynchronously,
    which then overlaps layer ``l``'s compute. gK/gV go back by a reduce-scatter in the view's backward.
    With activation checkpointing a recomputed block gathers its view again (on demand): AC trades the
    gathered view's memory for one more gather. Under op-level SAC nothing is prefetched (:func:`_in_op_sac`).
    """

    lazy = True

    def __init__(
        self,
        process_group,
        layout: SequenceLayout,
        *,
        prefetch: bool,
        stats: CommStats,
        collectives: Collectives,
    ) -> None:
        self.process_group, self.layout, self.prefetch = process_group, layout, prefetch
        self.stats, self.collectives = stats, collectives
        self.pending: dict[int, _PrefixGather] = {}
        self.seen: set[int] = set()
        self.stop: int | None = None

    def begin(self, cache: PrefixKVCache, stop: int | None = None) -> None:
        self.end()
        self.stop = stop  # no prefetch of a layer the forward stops before reading

    def read(self, cache: PrefixKVCache, layer: int, dtype: torch.dtype):
        if layer not in cache.layers:
            return None
        gather = self.pending.pop(layer, None)
        prefetched = gather is not None
        if not prefetched:
            gather = _PrefixGather(self, cache, layer, dtype)
        gather.wait(self.stats, ("gather_wait_s", "exposed_s"), prefetched)
        if prefetched:
            self.stats.prefetched_gathers += 1
        else:
            self.stats.demand_gathers += 1
        self.stats.gather_bytes += _wire(gather.out.numel() * gather.out.element_size(), self.layout.size)
        self.seen.add(layer)
        # Prefetch runs ahead of the forward only: a checkpointed block recomputing in the backward (reverse
        # layer order) re-gathers its own view on demand and starts nothing for a layer already read.
        nxt = layer + 1
        ahead = self.stop is None or nxt < self.stop
        if (
            self.prefetch
            and ahead
            and not _in_op_sac()
            and nxt in cache.layers
            and nxt not in self.pending
            and nxt not in self.seen
        ):
            self.pending[nxt] = _PrefixGather(self, cache, nxt, dtype)
        entry = cache.layers[layer]
        return _PrefixViewFn.apply(entry.prefix_k, entry.prefix_v, gather.out, self)

    def scatter_back(self, grad_k, grad_v, leaf_dtype: torch.dtype):
        """Reduce-scatter a gathered view's gK/gV (``[1, H, P, D]``) into this rank's shard."""
        size, local_len = self.layout.size, self.layout.local_len
        ref = grad_k if grad_k is not None else grad_v
        _, h, _, d = ref.shape
        wide = torch.promote_types(_wide(ref.dtype), leaf_dtype)
        buf = torch.zeros(2, 1, h, size * local_len, d, dtype=wide, device=ref.device)
        _, order = self.layout.on(ref.device)
        for i, g in enumerate((grad_k, grad_v)):
            if g is not None:
                buf[i].index_copy_(2, order, g.to(wide))
        send = buf.view(2, 1, h, size, local_len, d).permute(3, 0, 1, 2, 4, 5).contiguous()
        recv = buf.new_empty(2, 1, h, local_len, d)
        blocked = Blocked(recv.device)
        self.collectives.reduce_scatter(recv, send.view(size * 2, 1, h, local_len, d), self.process_group)
        blocked.stop(self.stats, ("scatter_s", "exposed_s"))
        self.stats.scatters += 1
        self.stats.scatter_bytes += _wire(send.numel() * send.element_size(), size)
        return recv[0].to(leaf_dtype), recv[1].to(leaf_dtype)

    def end(self) -> None:
        # A forward that stopped early leaves a prefetch in flight: finish it so no collective dangles.
        for gather in self.pending.values():
            gather.work.wait()
            self.stats.unused_prefetches += 1
        self.pending.clear()
        self.seen.clear()


class ContextParallel(ScheduleHooks):
    """The CP schedule hook: shards every microbatch over ``process_group``, gathers K/V inside attention, exchanges
    the prefix K/V (PrefixFlow), sums the loss and all-reduces the group's new parameter gradients.

    ``prefetch``: overlap the next layer's prefix gather with the current layer (False: on demand).
    ``reduce_grads``: all-reduce gradients over the CP group after each group (False when another
    transformation, e.g. FSDP over a mesh that includes ``cp``, reduces them). ``prefix_process_group``: the process
    group of the same ranks that carries the prefix K/V traffic (default ``group``); a group of its own keeps
    a prefetched gather from queueing with the sequence exchange on one communicator.
    """

    def __init__(
        self,
        process_group,
        *,
        prefetch: bool = True,
        reduce_grads: bool = True,
        collectives: Collectives | None = None,
        prefix_process_group=None,
    ) -> None:
        self.process_group = process_group
        self.prefix_process_group = prefix_process_group or process_group
        self.size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.prefetch = prefetch
        self.reduce_grads = reduce_grads
        self.collectives = collectives or Collectives()
        self.comm = CommStats()
        self.phase_b_ranks: list[float] = []
        self._phase_b_s = 0.0

    shards_sequences = True

    def check(self, model: nn.Module, group, system: str) -> None:
        if is_compiled(model):
            raise ValueError("context parallelism runs eager blocks; build the model without compile")

    @contextlib.contextmanager
    def group(self, model: nn.Module, group, system: str):
        self.comm = CommStats()
        self.phase_b_ranks, self._phase_b_s = [], 0.0
        params = [p for p in model.parameters() if p.requires_grad]
        earlier = {p: p.grad for p in params}
        for p in params:
            p.grad = None
        try:
            yield
            if self.reduce_grads:
                self._all_reduce_grads(params)
            self._gather_phase_b()
        finally:
            for p, g in earlier.items():
                if g is not None:
                    p.grad = g if p.grad is None else p.grad + g

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        self.comm._in_phase_b = name in ("B", "full")
        try:
            yield
        finally:
            self.comm._in_phase_b = False
            if name in ("B", "full"):
                if self._device().type == "cuda":
                    torch.cuda.synchronize()
                self._phase_b_s += time.perf_counter() - start

    def shard(self, mb: Microbatch) -> Microbatch:
        return shard_microbatch(mb, self.rank, self.size, self.process_group, self.comm, self.collectives)

    def prefix_view(self, model: nn.Module, length: int) -> PrefixView | None:
        if length < 1:
            return None
        layout = SequenceLayout(length, self.size)
        return CPPrefixView(
            self.prefix_process_group,
            layout,
            prefetch=self.prefetch,
            stats=self.comm,
            collectives=self.collectives,
        )

    def reduce_loss(self, value: float) -> float:
        with on_host():  # a host number (an estimate's too)
            total = torch.tensor([value], dtype=torch.float64, device=self._device())
            dist.all_reduce(total, group=self.process_group)
            return float(total.item())

    def stats(self) -> dict[str, float]:
        out = self.comm.as_dict()
        if self.phase_b_ranks:
            out["cp_phase_b_rank_min_s"] = min(self.phase_b_ranks)
            out["cp_phase_b_rank_max_s"] = max(self.phase_b_ranks)
            out["cp_phase_b_spread_s"] = max(self.phase_b_ranks) - min(self.phase_b_ranks)
        return out

    def _device(self) -> torch.device:
        if dist.get_backend(self.process_group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _gather_phase_b(self) -> None:
        """Every CP rank's Phase-B (baseline: whole-step) time, for the balance columns."""
        with on_host():  # host numbers (an estimate's fake group repeats this rank's)
            mine = torch.tensor([self._phase_b_s], dtype=torch.float64, device=self._device())
            every = mine.new_empty(self.size)
            dist.all_gather_into_tensor(every, mine, group=self.process_group)
            self.phase_b_ranks = every.tolist()

    def _all_reduce_grads(self, params: list[nn.Parameter]) -> None:
        """Sum this group's gradient contributions over the CP ranks (one flat all-reduce per dtype)."""
        locals_ = [_local(p.grad) for p in params if p.grad is not None]
        by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for g in locals_:
            by_dtype.setdefault((g.dtype, g.device), []).append(g)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.process_group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (tensor-parallel gradients), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def apply_cp(
    model: nn.Module,
    process_group,
    *,
    prefetch: bool = True,
    reduce_grads: bool = True,
    collectives: Collectives | None = None,
    dedicated_prefix_group: bool = True,
) -> ContextParallel:
    """Context-parallelise ``model`` over ``process_group`` (a ProcessGroup, or a 1-D DeviceMesh such as
    ``mesh["cp"]``): registers a :class:`ContextParallel` hook; returns it (its ``stats()`` hold the counters).
    The model's parameters must be identical on every CP rank. With ``dedicated_prefix_group`` the prefix K/V
    traffic gets a process group of its own; creating it is collective over the whole world, so every rank
    must call ``apply_cp`` (``parallelize`` does)."""
    groups = None
    if hasattr(process_group, "get_group"):
        groups = _mesh_groups(process_group)
        process_group = process_group.get_group()
    twin = _twin_group(process_group, groups) if dedicated_prefix_group else None
    hook = ContextParallel(
        process_group,
        prefetch=prefetch,
        reduce_grads=reduce_grads,
        collectives=collectives,
        prefix_process_group=twin,
    )
    add_hooks(model, hook)
    return hook


def _mesh_groups(mesh) -> list[tuple[int, ...]]:
    """The ranks of every group along a 1-D mesh (``mesh["cp"]``), read from its root mesh's layout: the
    sibling groups of ``mesh``'s dimension, with no collective (a fake process group gathers nothing)."""
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    name = mesh.mesh_dim_names[0]
    with on_host():
        if root is mesh or name not in (root.mesh_dim_names or ()):
            table = mesh.mesh.reshape(1, -1)
        else:
            dim = root.mesh_dim_names.index(name)
            table = root.mesh.movedim(dim, -1).reshape(-1, root.mesh.shape[dim])
        return [tuple(int(r) for r in row) for row in table.tolist()]


def _twin_group(process_group, groups: list[tuple[int, ...]] | None = None):
    """A new process group with the ranks of ``process_group``. ``new_group`` must be called by every rank of
    the world for every process group in the same order: ``groups`` are the ranks of every CP group (from the
    mesh); without them (a plain process group) they are gathered from the ranks."""
    mine = tuple(dist.get_process_group_ranks(process_group))
    if groups is None:
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        groups = every
    if mine not in groups:
        raise ValueError(f"CP group {list(mine)} is not one of the mesh's groups {sorted(set(groups))}")
    twin = None
    for ranks in sorted(set(groups)):
        created = dist.new_group(list(ranks), backend=dist.get_backend(process_group))
        if ranks == mine:
            twin = created
    return twin
