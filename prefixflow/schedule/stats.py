"""What one ``train_group`` call did (:class:`GroupStats`), and how the driver measures and counts it."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..memory.offload import OffloadStats

if TYPE_CHECKING:
    from .run import GroupRun


@dataclass
class GroupStats:
    """What one ``train_group`` call did. ``phase_times`` holds ``A``/``B``/``C`` (PrefixFlow) or ``full``
    (baseline) in seconds; ``prefix_tokens`` = cached prefix tokens (0 for the baseline); ``suffix_tokens`` =
    response tokens that carry loss; ``trunk_tokens`` = token slots the transformer processed (pads included)."""

    system: str
    layout: str
    loss: float
    n_microbatches: int
    prefix_tokens: int
    suffix_tokens: int
    trunk_tokens: int
    phase_times: dict[str, float] = field(default_factory=dict)
    offload: OffloadStats | None = None  # set when PrefixFlowConfig.offload is on
    hooks: dict[str, float] = field(default_factory=dict)  # counters of the schedule hooks (e.g. CP gathers)
    plan: dict | None = (
        None  # microbatch="auto": budget, measured footprint, chosen sizes (prefixflow.memory.budget)
    )
    tree: dict | None = None  # a prefix tree: nodes, unique tokens, per-node times, peak live nodes
    # Multimodal groups: the vision encoder's input tokens (patches) run, its forward FLOPs (FlopCounterMode),
    # and how many times it ran (PrefixFlow: once per node with images; the baseline: once per path).
    vision_tokens: int = 0
    vision_flops: int = 0
    vision_runs: int = 0

    @property
    def total_s(self) -> float:
        return sum(self.phase_times.values())


def group_stats(run: GroupRun, share, value: float, times, offload: OffloadStats | None, *, tree: bool):
    """The :class:`GroupStats` of a finished call (``run``: its ``GroupRun``; ``share``: its ``GroupShare``;
    ``tree``: whether the input was a ``RolloutTree``, whose nodes and per-node times ``GroupStats.tree``
    reports)."""
    rows, counters = run.rows, run.counters
    n_microbatches = len(run.chunks.chunks)
    prefix = 0
    if run.system != "baseline":
        prefix = rows.prefix_tokens if share.computes_prefix() else 0
        n_microbatches += counters.leafless_units  # objective-only microbatches of the paths with no leaf row
    suffix = sum(run.loss_data.response_lens[i] for i in share.paths(run.tree.n))
    summary = None
    if tree:
        summary = {
            "nodes": run.tree.n_nodes,
            "cached_nodes": len(rows.cached),
            "unique_tokens": run.tree.unique_tokens,
            "node_times": {j: dict(t) for j, t in counters.node_times.items()},
            "peak_live_nodes": counters.peak_live_nodes,
            "peak_cache_bytes": counters.peak_cache_bytes,
        }
    vision = getattr(run.inputs, "counts", None) or {}
    return GroupStats(
        run.system, run.layout, value, n_microbatches, prefix, suffix, counters.trunk_tokens, times,
        offload, hooks={**run.hooks.stats(), **run.stage.stats()}, plan=run.chunks.stats, tree=summary,
        vision_tokens=vision.get("tokens", 0), vision_flops=vision.get("flops", 0),
        vision_runs=vision.get("runs", 0),
    )  # fmt: skip


class PhaseClock:
    """Wall seconds per phase, summed over repeats (a tree's waves), synchronised on CUDA; ``observer``
    (optional) gets ``enter``/``exit`` per phase."""

    def __init__(self, device: torch.device, observer) -> None:
        self.device, self.observer, self.times = device, observer, {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        if self.observer is not None:
            self.observer.enter(phase)
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - start
            if self.observer is not None:
                self.observer.exit(phase)
