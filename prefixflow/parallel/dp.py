"""Data parallelism: rollout groups placed on DP ranks by cost, split groups, one gradient sync per step.

A step's groups go to the ``batch`` ranks (``dp_replicate x dp_shard``) by longest-processing-time over each
group's cost (:func:`group_costs`, a FLOP model of what the system runs). Each rank trains its groups whole.
When whole-group placement leaves the busiest rank more than ``split_threshold`` above the mean, the
largest group is split (paper §4.7): its owner runs Phase A and sends each helper only the prefix K/V; every
rank runs Phase B on its share of the suffixes; helpers send their accumulated gK/gV back; the owner sums
them and runs Phase C (:mod:`.dp_split`). Nothing else crosses ranks, and :class:`PrefixExchange` counts
those bytes. A split baseline group needs no exchange (its sequences are independent). Placement and its
cost model: :mod:`.dp_placement`.

Gradients then add up across DP once per step: FSDP2 reduce-scatters every unit once (HSDP also
all-reduces across ``dp_replicate``); with ``dp_replicate`` alone one all-reduce per dtype. Under ZeRO-3
FSDP every rank must run the same sequence of forwards and backwards, so a step whose ranks do different
work holds the parameters gathered for the step (``fsdp.gathered_for_step``).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..group import RolloutGroup
from ..schedule.driver import GroupStats, train_group
from ..schedule.grad_guard import keep_grads_on_failure
from ..schedule.host import on_host
from ..tree.rollout_tree import RolloutTree
from . import fsdp as fsdp_mod
from . import parallel_state
from .dp_placement import Placement, Work, group_costs, place_groups
from .dp_split import PrefixExchange, PrefixKVGeometry, check_captured, prefix_kv_geometry, train_split_part

__all__ = [
    "Work",
    "Placement",
    "StepStats",
    "PrefixExchange",
    "PrefixKVGeometry",
    "prefix_kv_geometry",
    "check_captured",
    "group_costs",
    "place_groups",
    "train_step",
    "all_reduce_gradients",
]


# -- gradient sync -------------------------------------------------------------------------------------
def all_reduce_gradients(model: nn.Module, group: dist.ProcessGroup) -> int:
    """Sum every parameter's gradient over ``group`` (missing gradients count as zero): one all-reduce per
    gradient dtype. Returns the number of all-reduces."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in model.parameters():
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        for g, new in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(new.view_as(g))
    return len(by_dtype)


# -- the step ------------------------------------------------------------------------------------------
@dataclass
class StepStats:
    """One optimizer step's worth of groups. ``loss``: the sum of the step's group losses (all ranks);
    ``suffix_tokens``/``trunk_tokens``: summed over all ranks; ``groups``: this rank's :class:`GroupStats`;
    ``grad_sync``: how gradients were reduced and how often."""

    system: str
    loss: float
    placement: Placement
    dp_rank: int
    suffix_tokens: int = 0
    trunk_tokens: int = 0
    groups: list[GroupStats] = field(default_factory=list)
    exchange: dict[str, int] = field(default_factory=dict)
    grad_sync: dict = field(default_factory=dict)
    time_s: float = math.nan

    @property
    def phase_times(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for g in self.groups:
            for k, v in g.phase_times.items():
                out[k] = out.get(k, 0.0) + v
        return out


def _lockstep(placement: Placement, microbatch: int | None, trees: set[int]) -> bool:
    """Whether every DP rank runs the same sequence of forwards and backwards (ZeRO-3 can then run). A prefix
    tree's count depends on its shape, so a step with trees on several ranks never counts as lockstep."""
    if trees and len(placement.work) > 1:
        return False

    def shape(ws: list[Work]):
        return [
            (len(w.responses) if microbatch is None else math.ceil(len(w.responses) / microbatch)) for w in ws
        ]

    if placement.split_groups:
        return False
    first = shape(placement.work[0])
    return all(shape(ws) == first for ws in placement.work)


def train_step(
    model: nn.Module,
    groups: list[RolloutGroup],
    *,
    system: str = "prefixflow",
    layout: str = "padded",
    microbatch: int | None = None,
    loss: str = "pg",
    loss_config=None,
    split_threshold: float | None = 0.25,
    observer=None,
) -> StepStats:
    """Train one optimizer step's ``groups`` across the model's DP ranks and reduce the gradients once.

    Every rank passes the same groups (all ranks compute the same placement). On a model without
    ``parallelize`` this trains every group locally. Accumulates into ``param.grad``; no optimizer step.
    Gradients are summed (no division by the number of groups). A non-finite gradient after the sync
    raises :class:`prefixflow.NonFiniteError` on every rank, with ``param.grad`` as before the call.
    """
    if not groups:
        raise ValueError("train_step needs at least one group")
    if microbatch == "auto":
        raise ValueError(
            "microbatch='auto' (sized to a memory budget) runs in train_group on one process; "
            "train_step needs an int microbatch or None"
        )
    state = parallel_state(model)
    n_ranks = state.dims.batch if state is not None else 1
    me = state.coordinate("batch") if state is not None and n_ranks > 1 else 0
    trees = {g for g, group in enumerate(groups) if isinstance(group, RolloutTree)}
    with on_host():  # the placement reads the caller's tensors (real under an estimate too: .schedule.host)
        costs = [group_costs(model, g, system) for g in groups]
    ep = state is not None and state.dims.ep > 1
    # Under EP groups stay whole: a split group's owner alone runs Phase A and C, out of the EP lockstep.
    # Prefix trees stay whole too (each node's cache lives on the rank that trains the tree).
    placement = place_groups(costs, n_ranks, None if ep else split_threshold, whole=trees)
    if ep and not _lockstep(placement, microbatch, trees):
        raise ValueError(
            f"ep={state.dims.ep}: the EP ranks run their MoE all-to-alls in lockstep, so every DP rank must "
            "train the same sequence of microbatches; give each rank as many groups, of the same sizes"
        )
    exchange = PrefixExchange(state.peers("batch") if n_ranks > 1 else [0])
    fsdp_on = state is not None and state.fsdp
    if fsdp_on:
        fsdp_mod.reset_collective_counts(model)
        zero3 = _lockstep(placement, microbatch, trees)
        sync = fsdp_mod.accumulate_groups(model) if zero3 else fsdp_mod.gathered_for_step(model)
        mode = "fsdp-zero3" if zero3 else "fsdp-gathered"
    else:
        sync, mode = contextlib.nullcontext(), "all-reduce" if n_ranks > 1 else "none"
    kwargs = dict(
        system=system,
        layout=layout,
        microbatch=microbatch,
        loss=loss,
        loss_config=loss_config,
        observer=observer,
    )
    stats = StepStats(system, math.nan, placement, me)
    start = time.perf_counter()
    all_reduces = 0
    # One gradient guard for the step (the groups' own are then no-ops): its verdict, after the gradient
    # sync, is collective on a parallel model, and every rank enters it once whatever its share of groups.
    with keep_grads_on_failure(model):
        with sync:
            for work in placement.work[me]:
                if work.split:
                    part = train_split_part(model, groups[work.group], work, me, exchange, **kwargs)
                    stats.groups.append(part)
                else:
                    stats.groups.append(train_group(model, groups[work.group], **kwargs))
        if mode == "all-reduce":
            all_reduces = all_reduce_gradients(model, state.mesh["dp_replicate"].get_group())
    stats.time_s = time.perf_counter() - start
    device = state.device if state is not None else torch.device("cpu")  # NCCL reduces device tensors
    with on_host():  # host numbers (the loss, byte counts): real tensors under an estimate too
        losses = [g.loss for g in stats.groups]
        local = (
            torch.tensor([sum(losses)], dtype=torch.float64, device=device) if None not in losses else None
        )
        if n_ranks > 1 and local is not None:
            dist.all_reduce(local, group=state.mesh["batch"].get_group())
        stats.loss = float(local) if local is not None else None  # None: an estimate's loss has no value
        keys = ("kv_bytes", "grad_kv_bytes", "expected_kv_bytes", "expected_grad_kv_bytes")
        tokens = [sum(g.suffix_tokens for g in stats.groups), sum(g.trunk_tokens for g in stats.groups)]
        counts = torch.tensor([getattr(exchange, k) for k in keys] + tokens, dtype=torch.int64, device=device)
        if n_ranks > 1:  # each transfer is counted once, by the rank that sends (or receives) it
            dist.all_reduce(counts, group=state.mesh["batch"].get_group())
        *exchanged, stats.suffix_tokens, stats.trunk_tokens = counts.tolist()
    stats.exchange = dict(zip(keys, exchanged, strict=True))
    stats.grad_sync = {"mode": mode, "all_reduces": all_reduces}
    if fsdp_on:
        counts = fsdp_mod.collective_counts(model)
        stats.grad_sync.update(
            units=fsdp_mod.n_units(model),
            reduce_scatters=sum(counts["reduce_scatter"].values()),
            max_reduce_scatters_per_unit=max(counts["reduce_scatter"].values(), default=0),
            all_gathers=sum(counts["all_gather"].values()),
        )
    return stats
