"""Timers, memory meters and rank-max for one training step (see docs/CONTRACTS.md).

* :class:`PhaseMeter` — the ``observer`` that ``train_group`` calls around each phase: CUDA events and
  ``torch.cuda.max_memory_allocated`` (reset per phase) on GPU, ``perf_counter`` and a
  ``prefixflow.memory.live_bytes.LiveBytesMeter`` (peak reset per phase) on CPU.
* :func:`rank_max` — element-wise MAX of a dict of numbers across ranks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

import torch

from prefixflow.memory.live_bytes import LiveBytesMeter

__all__ = ["PhaseMeter", "rank_max"]

CPU_METER = "cpu-live-bytes"
CUDA_METER = "cuda-max-allocated"


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
        self._foreign_base = self.live.foreign_freed if self.live is not None else 0

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
            # bytes a collective's worker thread freed late: how far a real peak may exceed the schedule's own
            late = self.live.foreign_freed - self._foreign_base if self.live is not None else math.nan
            res["foreign_freed_bytes"] = float(late)
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
