"""What one ``train_group`` call did (:class:`GroupStats`), and how the driver measures and counts it."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from ..group import RolloutGroup
from ..memory.offload import OffloadStats
from . import tree_phases


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
    tree: dict | None = None  # a prefix tree: nodes, unique tokens, per-node times (tree_phases.tree_summary)

    @property
    def total_s(self) -> float:
        return sum(self.phase_times.values())


def group_stats(run, share, value: float, times, offload: OffloadStats | None) -> GroupStats:
    """The :class:`GroupStats` of a finished ``run_group`` (``run``: its ``GroupRun``; ``share``: its ``GroupShare``)."""
    group, chunks = run.group, run.plan.chunks
    n_microbatches, tree = len(chunks), None
    if run.tree_plan is not None:
        tree = tree_phases.tree_summary(run)
        n_microbatches, prefix, suffix_tokens, trunk = tree_phases.tree_counts(run)
    elif run.system == "baseline":
        suffix_tokens = sum(group.response_lens[i] for i in share.responses(group))
        prefix, trunk = 0, trunk_tokens(group, chunks, run.layout, group.prompt_len)
    else:
        suffix_tokens = sum(group.response_lens[i] for i in share.responses(group))
        prefix = group.prompt_len - 1 if share.computes_prefix() else 0
        trunk = prefix + trunk_tokens(group, chunks, run.layout, 1)
    return GroupStats(
        run.system, run.layout, value, n_microbatches, prefix, suffix_tokens, trunk, times,
        offload,
        hooks={**run.hooks.stats(), **run.stage.stats()}, plan=run.plan.stats, tree=tree,
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


def trunk_tokens(group: RolloutGroup, chunks, layout: str, lead: int) -> int:
    """Token slots the trunk runs: each sequence is ``lead`` context tokens + its response minus one."""
    lens = [lead + s - 1 for s in group.response_lens]
    if layout == "packed":
        return sum(lens[i] for c in chunks for i in c)
    return sum(len(c) * max(lens[i] for i in c) for c in chunks)
