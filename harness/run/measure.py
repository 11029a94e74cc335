"""Timers, memory meters and rank-max for one training step (see docs/CONTRACTS.md).

* :class:`LiveBytesMeter` — an allocator-level live-bytes meter for CPU runs. A ``TorchDispatchMode``
  records every new untyped storage an aten op returns (its ``nbytes``) in a ``WeakKeyDictionary`` and
  subtracts it again from a ``weakref.finalize`` callback when the storage dies. Pre-existing tensors
  (parameters, buffers, existing grads) are counted after :meth:`LiveBytesMeter.register`. Storages that
  an offload tier moves off the "device" are counted apart (``offloaded``), either by
  :meth:`LiveBytesMeter.exclude` after the fact or by allocating them inside :meth:`offload_scope`.
  Workspace a single kernel allocates and frees internally is invisible, as it is not an aten output.
* :class:`PhaseMeter` — the ``observer`` that ``train_group`` calls around each phase: CUDA events and
  ``torch.cuda.max_memory_allocated`` (reset per phase) on GPU, ``perf_counter`` and a
  :class:`LiveBytesMeter` (peak reset per phase) on CPU.
* :func:`rank_max` — element-wise MAX of a dict of numbers across ranks.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytesMeter", "PhaseMeter", "rank_max"]

CPU_METER = "cpu-live-bytes"
CUDA_METER = "cuda-max-allocated"


def _storage_of(obj: torch.Tensor | torch.UntypedStorage) -> torch.UntypedStorage:
    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage()
    if isinstance(obj, torch.UntypedStorage):
        return obj
    if isinstance(obj, torch.TypedStorage):
        return obj.untyped_storage()
    raise TypeError(f"expected a tensor or storage, got {type(obj).__name__}")


class LiveBytesMeter(TorchDispatchMode):
    """Live and peak bytes of tensor storages on one device type (default ``"cpu"``).

    ``current``/``peak`` count resident ("device") bytes; ``offloaded``/``offloaded_peak`` count bytes
    an offload tier marked as moved out. The mode may be entered and left repeatedly; storages it has
    seen stay tracked (and their frees counted) while it is not active.
    """

    def __init__(self, device_type: str = "cpu") -> None:
        super().__init__()
        self.device_type = device_type
        # re-entrant: an allocation under the lock can run the GC, whose finalizers free other storages
        self._lock = threading.RLock()
        self._tracked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storage -> [nbytes, off]
        self._offload_depth = 0
        self.current = 0
        self.peak = 0
        self.offloaded = 0
        self.offloaded_peak = 0

    # -- accounting ---------------------------------------------------------------------------------
    def _track(self, storage: torch.UntypedStorage, offloaded: bool) -> None:
        if storage.device.type != self.device_type:
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
            self._add(-entry[0], entry[1])
            entry[0] = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        offloaded = self._offload_depth > 0
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                self._track(leaf.untyped_storage(), offloaded)
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
            self._track(_storage_of(t), offloaded=False)
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


class PhaseMeter:
    """Observer with ``enter(phase)``/``exit(phase)``: per-phase time and peak memory.

    On CPU the live-bytes mode is active inside each phase; wrap the whole step in ``with meter:`` to
    also see allocations between phases. Pass ``model`` (or call :meth:`register`) so parameters count
    as live, as they do in ``torch.cuda.max_memory_allocated``. Create one meter per measured step or
    call :meth:`reset`. A phase entered more than once accumulates time and keeps its largest peak.

    The CPU meter costs some Python work per aten op (~15 us); for timing-only repeats pass
    ``track_memory=False`` (memory is then NaN, ``mem_meter="none"``). CUDA memory stats are free.
    """

    def __init__(
        self, device: str | torch.device, model: torch.nn.Module | None = None, track_memory: bool = True
    ) -> None:
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.track_memory = track_memory or self.is_cuda
        self.mem_meter = CUDA_METER if self.is_cuda else CPU_METER if track_memory else "none"
        self.live = LiveBytesMeter(self.device.type) if not self.is_cuda and track_memory else None
        if model is not None and self.live is not None:
            self.live.register(model)
        self._outer = False
        self.reset()

    def reset(self) -> None:
        """Forget all phases (keeps the live-bytes tracking and registrations)."""
        self.times: dict[str, float] = {}
        self.peaks: dict[str, int] = {}
        self.offloaded_peaks: dict[str, int] = {}
        self._order: list[str] = []
        self._open: dict[str, object] = {}
        self._events: list[tuple[str, object, object]] = []
        self._first: object = None
        self._last: object = None

    def register(self, objs: torch.nn.Module | torch.Tensor | Iterable[torch.Tensor]) -> int:
        """Count pre-existing tensors as live on CPU (no-op on CUDA, where the allocator sees them)."""
        return 0 if self.live is None else self.live.register(objs)

    def __enter__(self) -> PhaseMeter:
        if self.live is not None:
            self.live.__enter__()
            self._outer = True
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None and self._outer:
            self._outer = False
            self.live.__exit__(*exc)

    def enter(self, phase: str) -> None:
        if phase in self._open:
            raise RuntimeError(f"phase {phase!r} entered twice without exit")
        if phase not in self._order:
            self._order.append(phase)
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._open[phase] = start
        else:
            if self.live is not None:
                if not self._outer:
                    self.live.__enter__()
                self.live.reset_peak()
            self._open[phase] = time.perf_counter()
        if self._first is None:
            self._first = self._open[phase]

    def exit(self, phase: str) -> None:
        if phase not in self._open:
            raise RuntimeError(f"phase {phase!r} exited without enter")
        start = self._open.pop(phase)
        if self.is_cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            torch.cuda.synchronize(self.device)
            self._events.append((phase, start, end))
            self._last = end
            peak, off_peak = torch.cuda.max_memory_allocated(self.device), 0
        else:
            now = time.perf_counter()
            self.times[phase] = self.times.get(phase, 0.0) + (now - start)
            self._last = now
            if self.live is None:
                peak, off_peak = math.nan, math.nan
            else:
                peak, off_peak = self.live.peak, self.live.offloaded_peak
                if not self._outer:
                    self.live.__exit__(None, None, None)
        self.peaks[phase] = max(self.peaks.get(phase, peak), peak)
        self.offloaded_peaks[phase] = max(self.offloaded_peaks.get(phase, off_peak), off_peak)

    def _resolve_times(self) -> tuple[dict[str, float], float]:
        if self._first is None:
            return {}, math.nan
        if not self.is_cuda:
            return dict(self.times), self._last - self._first
        torch.cuda.synchronize(self.device)
        times: dict[str, float] = {}
        for phase, start, end in self._events:
            times[phase] = times.get(phase, 0.0) + start.elapsed_time(end) / 1e3
        return times, self._first.elapsed_time(self._last) / 1e3

    def results(self, extended: bool = False) -> dict:
        """The contract's keys; ``extended`` adds per-phase peaks and offloaded-tier peaks."""
        if self._open:
            raise RuntimeError(f"phases still open: {sorted(self._open)}")
        times, step = self._resolve_times()
        peak = max(self.peaks.values(), default=math.nan)
        phase_b_peak = self.peaks.get("B", peak)
        res = {
            "phase_a_s": times.get("A", math.nan),
            "phase_b_s": times.get("B", math.nan),
            "phase_c_s": times.get("C", math.nan),
            "step_time_s": step,
            "peak_mem_bytes": float(peak),
            "peak_mem_phase_b_bytes": float(phase_b_peak),
            "mem_meter": self.mem_meter,
        }
        if extended:
            res["phase_peak_bytes"] = dict(self.peaks)
            res["phase_times_s"] = times
            res["offloaded_peak_bytes"] = float(max(self.offloaded_peaks.values(), default=math.nan))
            res["offloaded_peak_phase_b_bytes"] = float(self.offloaded_peaks.get("B", math.nan))
        return res


def rank_max(d: dict) -> dict:
    """Element-wise MAX of the numeric values of ``d`` across ranks (identity when not distributed).

    Non-numeric values pass through unchanged; NaN stays NaN only where every rank has NaN.
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return dict(d)
    keys = [k for k, v in d.items() if isinstance(v, int | float) and not isinstance(v, bool)]
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    vals = torch.tensor(
        [-math.inf if math.isnan(float(d[k])) else float(d[k]) for k in keys],
        dtype=torch.float64,
        device=device,
    )
    if keys:
        dist.all_reduce(vals, op=dist.ReduceOp.MAX)
    out = dict(d)
    for k, v in zip(keys, vals.tolist(), strict=True):
        out[k] = math.nan if v == -math.inf else v
    return out
