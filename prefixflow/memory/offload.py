"""Offload of dormant prefix saved tensors between Phase A and Phase C (paper §4.2, DESIGN §3).

During Phase B only the prefix K/V (read) and gK/gV (written) are hot; every other tensor the prefix graph
saved for backward is dormant until Phase C. ``PrefixOffload`` moves those tensors out of device memory:

* **Pack (Phase A).** ``saving()`` installs ``torch.autograd.graph.saved_tensors_hooks`` around the prefix
  forward. A saved tensor stays resident (the hook keeps ``tensor.detach()`` and its version) when it is not a plain
  float/complex tensor on the model's device, when its storage is smaller than ``min_bytes`` (default 4 KiB),
  or when its storage is one Phase B reads: a parameter/buffer of the model or a live K/V of the cache
  (``CapturePrefix`` records K/V before the attention kernel saves them). A DTensor (TP, FSDP2) is judged and
  moved by its local shard; unpacking rebuilds the wrapper over the loaded shard with its spec. Everything
  else is offloaded **by storage**: the whole untyped storage is copied out once (several saved views of one storage share one
  slot) and the tensor is rebuilt on unpack with its exact dtype, offset, size and stride, so the backward
  sees bit-identical inputs. Each saved tensor is tagged with the block that produced it (forward pre-hooks).
* **Tiers.** ``"cuda-pinned"``: copies to a pinned host pool on a side stream (``record_stream`` keeps the
  source alive until its copy is done, then the caching allocator reuses it). The pool is a list of pinned
  chunks; the first is sized 1.5x the Phase-A offload footprint measured in the previous group of the same
  model (64 MiB when there is none yet) and it grows by 1.5x when full, so no dry pass is needed.
  ``"cpu-file"``: on a CPU the "device" is process memory, so the tier is a temporary file (unlinked at
  once, closed at release): a worker thread ``pwrite``s each storage and the in-memory tensor is dropped,
  so the bytes leave the process's working memory (they live in the kernel's page cache / on disk).
  ``saving()`` waits for the outstanding copies when Phase A ends, so Phase B starts with them freed.
* **In-place changes raise, as in autograd.** Saved-tensor hooks switch off autograd's own version check, so
  the offload does it: each saved tensor's version is recorded when it is packed, and unpacking a tensor that
  was modified in place since (through itself, its base or any view, also while its copy out was in flight)
  raises autograd's ``RuntimeError`` instead of handing the backward stale or torn bytes. An offloaded
  storage is watched through a storage-less alias that shares the tensor's version counter.
* **Prefetch / demand-load (Phase C).** ``prefetch()`` starts loading the deepest layer's slots (and
  ``ahead`` more layers) in reverse layer order; each time the backward reaches a lower layer the window
  moves down. Loads run on a side stream (CUDA) or the worker thread into buffers allocated by the caller.
  A slot that is not back yet when the backward needs it is waited for, or loaded on demand if its load
  has not started (``late_bytes``); with ``prefetch=False`` every slot is demand-loaded. Correctness never depends on overlap.
* **Dead slots.** Phase A runs the last block completely but Phase C only needs what leads to K/V; autograd
  frees the rest of the graph when Phase A's output is dropped. A slot whose every saved handle died is
  freed and never loaded (``dropped_bytes``), so ``offloaded = prefetched + demand_loaded + dropped``.
* **Release.** ``release()`` (after Phase C, or from the schedule's ``finally`` on an exception) stops the
  worker, closes the file or frees the pinned chunks; nothing survives a group.

With activation checkpointing the checkpoint's own hooks are innermost inside each block, so these hooks see
what AC leaves saved outside them: the block inputs (non-reentrant ``checkpoint`` saves them with
``save_for_backward``). The outputs selective AC keeps live in SAC's own cache; ``sac_cache.sac_offloading``
routes that cache through the same pack and unpack, so they leave too.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..model.adapters import adapter_for
from .fake_tier import TIER_FAKE, FakePool
from .sac_cache import sac_offloading
from .storage import (
    TIER_CPU,
    TIER_CUDA,
    FilePool,
    Kept,
    Packed,
    PinnedPool,
    ShardPacked,
    Slot,
    check_version,
)

__all__ = ["OffloadStats", "PrefixOffload", "TIER_CPU", "TIER_CUDA", "TIER_FAKE", "TIERS", "DEFAULT_MIN_BYTES"]

DEFAULT_MIN_BYTES = 4096
TIERS = ("auto", TIER_FAKE)  # as PrefixFlowConfig.offload_tier: by device, or an estimate's (.fake_tier)
_FOOTPRINT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> last group's offloaded bytes


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``t``'s bytes on this rank: a DTensor's (TP, FSDP2) local shard."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


@dataclass
class OffloadStats:
    """What the offload of one group did (bytes are whole storages)."""

    tier: str
    prefetch: bool
    saved_tensors: int = 0  # pack-hook calls
    kept: dict[str, int] = field(default_factory=dict)  # reason -> saved tensors kept resident
    offloaded_tensors: int = 0  # distinct storages moved out
    offloaded_bytes: int = 0
    prefetched_bytes: int = 0  # loads the prefetcher issued ahead of need
    late_bytes: int = 0  # part of prefetched_bytes not back yet when needed (waited for or read inline)
    demand_loaded_bytes: int = 0  # loads issued only when the backward needed them
    dropped_bytes: int = 0  # moved out, then freed by autograd without being needed
    pool_capacity_bytes: int = 0
    released: bool = False

    @property
    def loaded_bytes(self) -> int:
        return self.prefetched_bytes + self.demand_loaded_bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "loaded_bytes": self.loaded_bytes}


def _blocks_of(model: nn.Module) -> list[nn.Module]:
    """The model's decoder blocks (layer tags for the prefetch order); none for a model no adapter knows."""
    try:
        return adapter_for(model).blocks(model)
    except TypeError:
        return []


class PrefixOffload:
    """Offload of the dormant saved tensors of one group's prefix graph (see the module docstring).

    ``model``: the TorchTitan model (its parameters/buffers stay resident, its blocks give layer tags);
    ``cache``: the group's ``PrefixKVCache`` (its live K/V stay resident); ``prefetch``: False = demand-load
    only; ``min_bytes``: storages below this stay resident; ``ahead``: layers loaded ahead of the backward;
    ``tier``: ``"auto"`` (by device) or ``"fake"`` (under an estimate's FakeTensorMode, ``.fake_tier``).
    """

    def __init__(
        self,
        model: nn.Module,
        cache,
        *,
        prefetch: bool = True,
        min_bytes: int = DEFAULT_MIN_BYTES,
        ahead: int = 1,
        tier: str = "auto",
    ) -> None:
        if tier not in TIERS:
            raise ValueError(f"offload tier {tier!r} unknown; valid: {TIERS}")
        self.model, self.cache, self.min_bytes, self.ahead = model, cache, min_bytes, ahead
        self.device = next(model.parameters()).device
        self._blocks = _blocks_of(model)
        hint = _FOOTPRINT.get(model, 0)
        if tier == TIER_FAKE:
            self.pool = FakePool()
        else:
            self.pool = PinnedPool(self.device, hint) if self.device.type == "cuda" else FilePool()
        key = self.pool.key
        self._protected = {key(_local(t).untyped_storage()) for t in (*model.parameters(), *model.buffers())}
        self.stats = OffloadStats(tier=self.pool.tier, prefetch=prefetch)
        self._lock = threading.RLock()
        self._slots: list[Slot] = []
        self._by_storage: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._layer = -1
        self._frontier: int | None = None  # lowest layer the backward has reached
        self._scheduled: set[int] = set()

    # -- Phase A ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Offload what the enclosed forward saves; on normal exit wait for the copies out."""
        hooks = [
            b.register_forward_pre_hook(functools.partial(self._enter_block, i))
            for i, b in enumerate(self._blocks)
        ]
        try:
            with (
                torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack),
                sac_offloading(self.model, self._pack, self._unpack),
            ):
                yield
            with self._lock:
                self.pool.finish_stores()
                self._keep_late_kv()
        finally:
            for h in hooks:
                h.remove()
            self._layer = -1

    def _keep_late_kv(self) -> None:
        """SAC caches an op's output when the op runs, before ``CapturePrefix`` records it as K/V (V is the
        value projection's output, viewed): such a slot's storage stays live for Phase B anyway, so it is
        kept resident after all, its handles reading the live bytes (the copy out is never read)."""
        kv = self._kv_storages()
        for storage, slot in list(self._by_storage.items()):
            live = kv.get(self.pool.key(storage))
            if slot.loaded or slot.handles == 0 or live is None:
                continue
            slot.data, slot.loaded = self.pool.resident(live), True
            self.stats.offloaded_tensors -= 1
            self.stats.offloaded_bytes -= slot.nbytes
            self.stats.kept["kv"] = self.stats.kept.get("kv", 0) + slot.handles

    def _enter_block(self, index: int, module, args) -> None:
        self._layer = index

    def _keep_reason(self, t: torch.Tensor) -> str | None:
        if not self.pool.plain(t):
            return "subclass"
        if not (t.dtype.is_floating_point or t.dtype.is_complex) or t.is_conj() or t.is_neg():
            return "non_float"
        if t.device != self.device or t.layout != torch.strided:
            return "other_device"
        storage = t.untyped_storage()
        if storage.nbytes() < self.min_bytes:
            return "small"
        key = self.pool.key
        ptr = key(storage)
        if ptr in self._protected:
            return "param"
        if ptr in self._kv_storages():
            return "kv"
        return None

    def _kv_storages(self) -> dict:
        """The storages of the cache's live K/V (what Phase B reads): storage key -> the K or V tensor."""
        key = self.pool.key
        return {
            key(_local(t).untyped_storage()): t for e in self.cache.layers.values() for t in (e.live_k, e.live_v)
        }

    def _pack(self, t: torch.Tensor):
        with self._lock:
            self.stats.saved_tensors += 1
            wrapper = t if isinstance(t, DTensor) else None  # its local shard moves; the wrapper is rebuilt
            local = t._local_tensor if wrapper is not None else t
            reason = self._keep_reason(local)
            if reason is not None:
                self.stats.kept[reason] = self.stats.kept.get(reason, 0) + 1
                return Kept(t, self._layer)
            storage = local.untyped_storage()
            slot = self._by_storage.get(storage)
            if slot is None or slot.version != local._version or slot.handles == 0:
                slot = Slot(len(self._slots), self._layer, local)
                self._slots.append(slot)
                self._by_storage[storage] = slot
                self.pool.store(slot, local.detach())
                self.stats.offloaded_tensors += 1
                self.stats.offloaded_bytes += slot.nbytes
                self.stats.pool_capacity_bytes = self.pool.capacity()
            packed = Packed(self._drop_handle, slot, local)
            return packed if wrapper is None else ShardPacked(packed, wrapper)

    # -- Phase C ------------------------------------------------------------------------------------
    def prefetch(self) -> None:
        """Phase C is starting: begin loading the deepest layers (no-op when prefetch is off)."""
        with self._lock:
            live = [s.layer for s in self._slots if s.handles > 0]
            if self.stats.prefetch and live:
                self._advance(max(live))

    def _advance(self, frontier: int) -> None:
        """The backward reached ``frontier``: start loads down to ``frontier - ahead``, deepest first."""
        self._frontier = frontier
        for layer in range(frontier, frontier - self.ahead - 1, -1):
            if layer < -1 or layer in self._scheduled:
                continue
            self._scheduled.add(layer)
            for slot in reversed(self._slots):
                if slot.layer == layer and slot.handles > 0 and not slot.loaded:
                    self.pool.start_load(slot)
                    slot.loaded = True
                    self.stats.prefetched_bytes += slot.nbytes

    def _unpack(self, packed) -> torch.Tensor:
        if isinstance(packed, ShardPacked):
            where = "a DTensor's shard, offloaded"
            check_version(packed.alias, packed.version, packed.packed.slot.desc, where)
            return packed.rebuild(self._unpack(packed.packed))
        if isinstance(packed, Kept):
            t = packed.tensor
            check_version(t, packed.version, f"{t.dtype} {tuple(t.shape)}", f"layer {packed.layer}, resident")
            return t
        slot = packed.slot
        with self._lock:
            if self.stats.released:
                raise RuntimeError("PrefixOffload: a saved tensor was unpacked after the pool was released")
            # Before any load: a change made after the save (one racing the copy out too) voids the bytes.
            check_version(slot.alias, slot.version, slot.desc, f"layer {slot.layer}, offloaded")
            if slot.data is None:  # never scheduled: demand-load
                self.pool.load_now(slot)
                slot.loaded = True
                self.stats.demand_loaded_bytes += slot.nbytes
            elif slot.pending is not None:
                if not self.pool.complete_load(slot):
                    self.stats.late_bytes += slot.nbytes
                slot.pending = None
            data = slot.data
            if self.stats.prefetch and (self._frontier is None or slot.layer < self._frontier):
                self._advance(slot.layer)
        return self.pool.rebuild(data, packed.dtype, packed.offset, packed.size, packed.stride)

    def _drop_handle(self, slot: Slot) -> None:
        with self._lock:
            slot.handles -= 1
            if slot.handles > 0 or self.stats.released:
                return
            if slot.pending is not None:  # a prefetch nobody will consume
                if not self.pool.abandon(slot):
                    self.stats.prefetched_bytes -= slot.nbytes
                    slot.loaded = False
                slot.pending = None
            if not slot.loaded:
                self.stats.dropped_bytes += slot.nbytes
            slot.data = None  # file space / pinned regions are bump-allocated and returned at release

    # -- end of group -------------------------------------------------------------------------------
    def release(self) -> None:
        """Free the pool (file closed / pinned chunks returned); idempotent. Call after the prefix graph is gone."""
        with self._lock:
            if self.stats.released:
                return
            self.stats.pool_capacity_bytes = self.pool.capacity()
            self.stats.released = True
            try:
                self.pool.close()
            finally:
                for slot in self._slots:
                    slot.data = slot.pending = slot.alias = None
                self._slots.clear()
                self._by_storage.clear()
                _FOOTPRINT[self.model] = self.stats.offloaded_bytes


@contextlib.contextmanager
def offloading(offload: PrefixOffload | None) -> Iterator[None]:
    """``offload.saving()``, or nothing when offload is off."""
    if offload is None:
        yield
    else:
        with offload.saving():
            yield
