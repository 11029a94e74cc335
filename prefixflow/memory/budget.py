"""Microbatch chunks: fixed sizes, or ``microbatch="auto"``: the largest microbatches that fit a memory budget.

``train_group(..., microbatch="auto")`` spends a device-memory budget (``PrefixFlowConfig.memory_budget_bytes``)
on suffix wave size, the paper's relaxed suffix budget (§4.2): whatever the prefix state leaves free (less with
offload) goes to more suffixes per microbatch, so fewer, larger waves run.

**The budget** is the peak device memory the whole ``train_group`` call may reach, as the benchmark measures
it: on CUDA ``torch.cuda.memory_allocated`` (everything on the device, the optimizer state included); on CPU
the live bytes of the model's parameters, buffers and gradients plus every tensor the call allocates (the
harness's ``cpu-live-bytes`` meter).

**The footprint is measured, not estimated from a formula** (so activation checkpointing, dtypes and kernels
need no model). The first two microbatches run one response each. The first allocates what stays for the
group (parameter gradients, gK/gV); the second is the probe: the memory live at its start (``resident``) and
its peak above that, per token slot (``per_token``), give the plan ``resident + per_token x slots(b) <=
budget`` for the rest (slots: ``b x longest`` padded, ``Σ lengths`` packed), filled greedily in response
order. Memory is read by a small live-bytes dispatch mode (``prefixflow.memory.live_bytes.LiveBytesMeter``, which counts the model's
parameters, buffers and gradients and what it sees allocated), active during Phase A (on CPU, where nothing
else knows the bytes the prefix left live) and the two probes; it needs eager blocks (not ``apply_compile``).
A probe above the budget still runs the rest one response at a time; ``GroupStats.plan`` says so and an
:class:`OverBudgetWarning` is issued.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from prefixflow.memory.live_bytes import LiveBytesMeter
from prefixflow.schedule.host import has_values

__all__ = ["FixedChunks", "BudgetChunks", "AUTO", "OverBudgetWarning"]

AUTO = "auto"
PROBES = 2  # microbatches of one response before the plan: warm-up (grads, gK/gV), then the measured one


class OverBudgetWarning(UserWarning):
    """``microbatch="auto"``: even one response exceeds the memory budget; the group still runs, over it."""


class FixedChunks:
    """Microbatches of ``size`` of the given ``responses`` (None = all of them), in order: the one chunker of
    every schedule (a whole group's responses, or a split group's share)."""

    stats = None

    def __init__(self, responses: list[int], size: int | None) -> None:
        responses = list(responses)
        size = size if size is not None else max(1, len(responses))
        self.chunks = [responses[i : i + size] for i in range(0, len(responses), size)]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.chunks)

    def __len__(self) -> int:
        return len(self.chunks)

    def prefix_window(self):
        return contextlib.nullcontext()

    def measure(self, index: int):
        return contextlib.nullcontext()


class BudgetChunks:
    """``microbatch="auto"``: one-response probes, then the largest microbatches that fit ``budget`` bytes.

    ``lengths``: the input tokens of each response's sequence (suffix or full sequence; a tree path's leaf
    row or full path); ``ids``: the response (path) of each length (default ``0..n-1``); ``layout``: how a
    microbatch lays them out (its token slots). Iterate it for chunks; enter :meth:`prefix_window` around
    Phase A and :meth:`measure` around each microbatch (both balanced with other dispatch modes).
    """

    def __init__(
        self, model: nn.Module, lengths: list[int], layout: str, budget: int, ids: list[int] | None = None
    ) -> None:
        self.model, self.lengths, self.layout, self.budget = model, list(lengths), layout, int(budget)
        self.ids = list(range(len(self.lengths))) if ids is None else list(ids)  # what each length belongs to
        first = next(model.parameters())
        self.device = first.device
        # Under an estimate the parameters are fake: their storages (and all the call makes) live on "meta".
        self.meter = LiveBytesMeter(self.device.type if has_values(first) else ("meta", self.device.type))
        self.meter.register(self.model)
        self.resident: int | None = None
        self.per_token: float | None = None
        self.chunks: list[list[int]] = []

    def _now(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return self.meter.current

    @contextlib.contextmanager
    def prefix_window(self) -> Iterator[None]:
        """Phase A: on CPU, count what the prefix leaves live (cache, saved tensors); CUDA's allocator knows."""
        if self.device.type == "cuda":
            yield
            return
        with self.meter:
            yield

    @contextlib.contextmanager
    def measure(self, index: int) -> Iterator[None]:
        """Around microbatch ``index``: the probes run under the meter; the second one is measured."""
        if index >= PROBES:
            yield
            return
        probe = index == PROBES - 1
        start = self._now()
        self.meter.reset_peak()
        base = self.meter.current
        with self.meter:
            yield
        if probe:
            self.resident = start
            self.per_token = (self.meter.peak - base) / max(1, self._slots([index]))
            if not self._fits([index]):
                need = self.resident + self.per_token * self._slots([index])
                warnings.warn(
                    f"microbatch='auto': one response needs about {need / 2**20:.1f} MiB, more than "
                    f"memory_budget_bytes={self.budget} ({self.budget / 2**20:.1f} MiB); the group runs one "
                    "response at a time, over the budget (raise the budget, or shorten the responses)",
                    OverBudgetWarning,
                    stacklevel=2,
                )

    def _slots(self, chunk: list[int]) -> int:
        lens = [self.lengths[i] for i in chunk]
        return sum(lens) if self.layout == "packed" else len(lens) * max(lens)

    def _fits(self, chunk: list[int]) -> bool:
        return self.resident + self.per_token * self._slots(chunk) <= self.budget

    def __iter__(self) -> Iterator[list[int]]:
        n = len(self.lengths)
        i = 0
        while i < n:
            chunk = [i]
            if i >= PROBES and self.per_token is not None:
                while i + len(chunk) < n and self._fits([*chunk, i + len(chunk)]):
                    chunk.append(i + len(chunk))
            ids = [self.ids[j] for j in chunk]
            self.chunks.append(ids)
            yield ids
            i += len(chunk)

    @property
    def stats(self) -> dict:
        """What the plan saw and chose (``GroupStats.plan``)."""
        fits = None
        if self.per_token is not None:
            fits = self.resident + self.per_token * self._slots([PROBES - 1]) <= self.budget
        return {
            "budget_bytes": self.budget,
            "resident_bytes": self.resident,
            "per_token_bytes": self.per_token,
            "probe_fits": fits,
            "microbatch_sizes": tuple(len(c) for c in self.chunks),
        }
