"""An allocator-level live-bytes meter (CPU runs: the benchmark's ``cpu-live-bytes`` and
``microbatch="auto"``'s budget probes).

:class:`LiveBytesMeter` is a ``TorchDispatchMode`` that records every new untyped storage an aten op returns
(its ``nbytes``) in a ``WeakKeyDictionary`` and subtracts it again from a ``weakref.finalize`` callback when
the storage dies. Pre-existing tensors (parameters, buffers, existing grads) are counted after
:meth:`LiveBytesMeter.register`. Storages that an offload tier moves off the "device" are counted apart
(``offloaded``), either by :meth:`LiveBytesMeter.exclude` after the fact or by allocating them inside
:meth:`LiveBytesMeter.offload_scope`. Workspace a single kernel allocates and frees internally is invisible,
as it is not an aten output.

A storage that dies on another thread than the meter's (a gloo worker dropping a collective's buffer after
this thread let go of it) was live past its last use here for a time the meter cannot see:
``foreign_freed`` sums those bytes, a bound on what such late releases can add to a peak.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytesMeter"]


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold ``t``'s bytes: a wrapper subclass's inner tensors (a DTensor's local shard), else
    ``t``. A wrapper's own ``untyped_storage()`` is no allocation: a DTensor's reports its global size."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = (getattr(t, name) for name in names)
        return [x for i in inner if isinstance(i, torch.Tensor) for x in _plain(i)]
    return [t]


def _storage_of(obj: torch.Tensor | torch.UntypedStorage) -> torch.UntypedStorage:
    if isinstance(obj, torch.Tensor):
        return _plain(obj)[0].untyped_storage()
    if isinstance(obj, torch.UntypedStorage):
        return obj
    if isinstance(obj, torch.TypedStorage):
        return obj.untyped_storage()
    raise TypeError(f"expected a tensor or storage, got {type(obj).__name__}")


class LiveBytesMeter(TorchDispatchMode):
    """Live and peak bytes of tensor storages on one device type (default ``"cpu"``), or several (a tuple:
    an estimate's fake storages live on ``"meta"`` beside its real host tensors on ``"cpu"``).

    ``current``/``peak`` count resident ("device") bytes; ``offloaded``/``offloaded_peak`` count bytes
    an offload tier marked as moved out. The mode may be entered and left repeatedly; storages it has
    seen stay tracked (and their frees counted) while it is not active.
    """

    def __init__(self, device_type: str | tuple[str, ...] = "cpu") -> None:
        super().__init__()
        self.device_type = device_type
        self._types = (device_type,) if isinstance(device_type, str) else tuple(device_type)
        # re-entrant: an allocation under the lock can run the GC, whose finalizers free other storages
        self._lock = threading.RLock()
        self._tracked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storage -> [nbytes, off]
        self._offload_depth = 0
        self.current = 0
        self.peak = 0
        self.offloaded = 0
        self.offloaded_peak = 0
        self.foreign_freed = 0  # resident bytes whose storage died on another thread
        self._thread = threading.get_ident()

    # -- accounting ---------------------------------------------------------------------------------
    def _track(self, storage: torch.UntypedStorage, offloaded: bool) -> None:
        if storage.device.type not in self._types:
            return
        nbytes = storage.nbytes()
        with self._lock:
            entry = self._tracked.get(storage)
            if entry is None:
                entry = [0, offloaded]
                self._tracked[storage] = entry
                weakref.finalize(storage, self._on_free, entry).atexit = False
            delta = nbytes - entry[0]  # a resize of a known storage counts its growth
            if delta == 0:
                return
            entry[0] = nbytes
            self._add(delta, entry[1])

    def _add(self, delta: int, offloaded: bool) -> None:
        if offloaded:
            self.offloaded += delta
            self.offloaded_peak = max(self.offloaded_peak, self.offloaded)
        else:
            self.current += delta
            self.peak = max(self.peak, self.current)

    def _on_free(self, entry: list) -> None:
        with self._lock:
            if threading.get_ident() != self._thread and not entry[1]:
                self.foreign_freed += entry[0]
            self._add(-entry[0], entry[1])
            entry[0] = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        offloaded = self._offload_depth > 0
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                for t in _plain(leaf):
                    if t.device.type != "meta":
                        self._track(t.untyped_storage(), offloaded)
        return out

    # -- public API ---------------------------------------------------------------------------------
    def register(self, objs: torch.nn.Module | torch.Tensor | Iterable[torch.Tensor]) -> int:
        """Count pre-existing tensors as live (a module: its parameters, their grads, and buffers).

        Returns the bytes newly counted; storages already tracked are not counted twice.
        """
        if isinstance(objs, torch.nn.Module):
            params = list(objs.parameters())
            tensors = [*params, *(p.grad for p in params if p.grad is not None), *objs.buffers()]
        elif isinstance(objs, torch.Tensor):
            tensors = [objs]
        else:
            tensors = list(objs)
        before = self.current + self.offloaded
        for t in tensors:
            for inner in _plain(t):
                self._track(inner.untyped_storage(), offloaded=False)
        return self.current + self.offloaded - before

    def exclude(self, obj: torch.Tensor | torch.UntypedStorage) -> int:
        """Mark a storage as offloaded: its bytes move from ``current`` to ``offloaded``.

        Returns the bytes moved (0 if it was already offloaded or lives on another device type).
        """
        storage = _storage_of(obj)
        self._track(storage, offloaded=False)
        with self._lock:
            entry = self._tracked.get(storage)
            if entry is None or entry[1]:
                return 0
            self.current -= entry[0]
            entry[1] = True
            self.offloaded += entry[0]
            self.offloaded_peak = max(self.offloaded_peak, self.offloaded)
            return entry[0]

    def is_offloaded(self, obj: torch.Tensor | torch.UntypedStorage) -> bool:
        entry = self._tracked.get(_storage_of(obj))
        return bool(entry is not None and entry[1])

    @contextmanager
    def offload_scope(self) -> Iterator[LiveBytesMeter]:
        """Storages created inside this block count as offloaded (an offload tier's pool/buffers)."""
        self._offload_depth += 1
        try:
            yield self
        finally:
            self._offload_depth -= 1

    def reset_peak(self) -> None:
        """Start a new peak window at the current level (both tiers)."""
        with self._lock:
            self.peak = self.current
            self.offloaded_peak = self.offloaded
