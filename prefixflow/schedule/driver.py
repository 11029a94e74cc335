"""``train_group``: the one driver of the three-phase PrefixFlow schedule and of the full-sequence baseline.

Both systems share the model, the layouts, the loss and the LM-head placement (only at positions that
predict a response token); they differ only in the schedule:

- baseline:  for each microbatch of ``[P || S_i]`` sequences: forward, loss, backward (``phase_full``).
- PrefixFlow: ``phase_a_prefix_forward`` (cache K/V of ``P[:-1]`` once), ``phase_b_suffix_microbatches``
  (suffixes read the cache and accumulate gK/gV), ``phase_c_prefix_backward`` (one delayed prefix backward).

Every shape runs this driver (:func:`run_group`) and these phase functions. What differs enters as objects:
- *where* the model runs: the runtime's :class:`~prefixflow.schedule.stage.Stage` (one device; a pipeline stage,
  set by ``apply_pp``, runs its slice of the layers 1F1B);
- *which part of the group* this rank trains: a :class:`GroupShare` (the whole group; a split group's part,
  ``prefixflow.parallel.dp_split``, which receives the prefix K/V instead of computing them);
- parallelism and MoE: the model's schedule hooks (:mod:`prefixflow.hooks`).
The prefix is one node with its own cache and its own delayed backward; a prefix tree (``RolloutTree``)
repeats Phase A per node top-down and Phase C per node bottom-up (:mod:`prefixflow.schedule.tree_phases`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..attention.modes import AttendWithPrefix, CapturePrefix, MaskedAttention, PrefixCaptured
from ..group import RolloutGroup
from ..hooks import HookChain, hooks_of
from ..loss import LossConfig, resolve_loss
from ..memory.budget import AUTO, BudgetPlan, FixedPlan
from ..memory.offload import PrefixOffload, offloading
from ..model.apply import PrefixFlowRuntime, runtime_of
from ..state.kv_cache import PrefixKVCache
from ..tree.layouts import (
    Microbatch,
    build_microbatch,
    full_sequence_segments,
    prefix_microbatch,
    suffix_segments,
)
from ..tree.plan import TreePlan
from ..tree.rollout_tree import RolloutTree
from . import tree_phases
from .grad_guard import keep_grads_on_failure
from .stage import Stage, attention_mode, forward_hidden
from .stats import GroupStats, PhaseClock, group_stats
from .validation import SYSTEMS, check_group, run_input, validate_call

__all__ = [
    "SYSTEMS",
    "GroupRun",
    "GroupShare",
    "GroupStats",
    "train_group",
    "run_group",
    "group_run",
    "check_group",
    "phase_a_prefix_forward",
    "phase_b_suffix_microbatches",
    "phase_c_prefix_backward",
    "phase_full",
    "forward_hidden",
]


@dataclass
class GroupRun:
    """One ``train_group`` call, resolved: what the phase functions read."""

    model: nn.Module
    runtime: PrefixFlowRuntime
    group: RolloutGroup | RolloutTree  # on the model's device
    system: str
    layout: str
    loss: str
    cfg: LossConfig
    stage: Stage
    hooks: HookChain
    device: torch.device
    plan: FixedPlan | BudgetPlan | None = None  # this rank's microbatches (response indices)
    tree_plan: TreePlan | None = None  # a tree's scoring plan (None for a flat group)
    loss_data: object = None  # what the loss reads per response/path: the group, or the tree's PathLosses


class GroupShare:
    """The part of a group this rank trains: here, all of it. ``prefix_forward``/``prefix_backward`` wrap the
    local Phase A/C work (``compute``); a split group's part overrides them to exchange the prefix K/V."""

    def responses(self, group: RolloutGroup) -> list[int]:
        return list(range(group.n))

    def computes_prefix(self) -> bool:
        return True

    def prefix_forward(self, run: GroupRun, cache: PrefixKVCache, compute):
        return compute()

    def prefix_backward(self, run: GroupRun, cache: PrefixKVCache, compute) -> None:
        compute()


# -- the phases -----------------------------------------------------------------------------------------
def phase_a_prefix_forward(
    run: GroupRun, cache: PrefixKVCache, offload: PrefixOffload | None = None, wave=None
) -> Microbatch | None:
    """Phase A: run the shared prefix ``P[:-1]`` forward once; each layer leaves its live K/V in ``cache``.
    With ``offload``, the other tensors the prefix graph saves move out of device memory as they are saved.
    Loss terms the hooks add during this forward (``extra_loss``) join Phase C's backward.
    Returns the prefix microbatch this rank ran (Phase C recomputes under its attention), None if empty.
    A tree (``cache``: its ``NodeCaches``) runs the forward of each cached node the ``wave`` reads first,
    top-down (each node's once in the whole call)."""
    if run.tree_plan is not None:
        return tree_phases.node_forwards(run, cache, wave)
    if run.group.prompt_len == 1:
        return None  # one-token prompt: nothing to cache, suffixes start at position 0
    mb = run.hooks.shard(prefix_microbatch(run.group, run.device))
    stop = _last_needed_layer(run) if run.stage.holds_loss else None
    mode = CapturePrefix(cache, stop, mask=mb.mask, sequence=mb.sequence)
    with run.runtime.state.use(mode), offloading(offload):
        try:
            run.stage.prefix_forward(run, mb)
        except PrefixCaptured:
            pass  # the last layer's K/V are in the cache; the rest of the prefix forward is dead work
    cache.add_prefix_loss(run.hooks.extra_loss())
    return mb


def _last_needed_layer(run: GroupRun) -> int | None:
    """The layer after whose K/V Phase A may stop, or None to run the whole forward.

    A checkpointed last block runs to its end: its recomputation in Phase C must save exactly what the
    original forward saved. So does every block when a schedule hook reads prefix work past the last K/V.
    """
    adapter = run.runtime.adapter
    if adapter.block_is_checkpointed(adapter.blocks(run.model)[-1]) or run.hooks.full_prefix_forward():
        return None
    return run.runtime.n_wrapped - 1


def phase_b_suffix_microbatches(run: GroupRun, cache: PrefixKVCache, wave=None) -> float:
    """Phase B: train the suffixes as ordinary microbatches reading the cache; returns the group loss.
    ``run.plan`` yields each microbatch's responses (:mod:`prefixflow.memory.budget`: fixed sizes, or sized to a
    budget). A tree trains the ``wave``'s paths' leaf rows, reading each path's ancestor nodes."""
    if run.tree_plan is not None:
        return tree_phases.leaf_microbatches(run, cache, wave)
    segments = suffix_segments(run.group)
    variant = run.runtime.config.attention_for(run.device)

    def build(chunk):
        mb = _microbatch(run, [segments[i] for i in chunk], run.group.prompt_len - 1)
        mode = AttendWithPrefix(cache, mb.mask, variant, sequence=mb.sequence, causal_suffix=mb.causal_suffix)
        return mb, mode

    return run.stage.microbatches(run, build)


def phase_c_prefix_backward(
    run: GroupRun,
    cache: PrefixKVCache,
    prefix: Microbatch | None,
    offload: PrefixOffload | None = None,
    wave=None,
) -> None:
    """Phase C: inject the accumulated gK/gV into the retained prefix graph; one prefix backward.
    With ``offload``, its saved tensors are prefetched in reverse layer order (or demand-loaded).
    Checkpointed prefix blocks recompute under the prefix's attention (Phase A's minus the capture: plain
    causal, or the sharded prefix's when its tokens are spread over ranks). A tree runs the backward of each
    cached node no later path of the ``wave`` reads, children before parents (each node's once)."""
    if run.tree_plan is not None:
        return tree_phases.node_backwards(run, cache, wave)
    if offload is not None:
        offload.prefetch()
    recompute = None  # unsharded: no mode, the plain forward's causal attention
    if prefix is not None and prefix.sequence is not None:
        recompute = MaskedAttention(prefix.mask, prefix.sequence)
    with attention_mode(run, recompute), run.hooks.prefix_backward():
        run.stage.prefix_backward(run, cache)


def phase_full(run: GroupRun) -> float:
    """The baseline's one phase: every ``[P || S_i]`` sequence (a tree: every path) forward and backward, in
    microbatches."""
    if run.tree_plan is not None:
        return tree_phases.path_microbatches(run)
    segments = full_sequence_segments(run.group)

    def build(chunk):
        mb = _microbatch(run, [segments[i] for i in chunk], None)
        return mb, MaskedAttention(mb.mask, mb.sequence) if mb.mask is not None else None

    return run.stage.microbatches(run, build)


def _microbatch(run: GroupRun, segments, cached_prefix_len: int | None) -> Microbatch:
    """Lay out ``segments``; the schedule hooks keep the part this rank computes (``ScheduleHooks.shard``)."""
    mb = build_microbatch(
        run.group, segments, run.layout, cached_prefix_len=cached_prefix_len, device=run.device
    )
    return run.hooks.shard(mb)


# -- the driver -----------------------------------------------------------------------------------------
def train_group(
    model: nn.Module,
    group: RolloutGroup,
    *,
    system: str = "prefixflow",
    layout: str = "padded",
    microbatch: int | str | None = None,
    loss: str = "pg",
    loss_config: dict | LossConfig | None = None,
    observer=None,
) -> GroupStats:
    """Train one rollout group: accumulate its gradients into ``param.grad`` (no zeroing, no optimizer step).

    ``system``: ``"prefixflow"`` (three phases) or ``"baseline"`` (full sequences); ``layout``: ``"padded"`` or
    ``"packed"``; ``microbatch``: responses per microbatch (None = all), or ``"auto"``: the largest
    microbatches whose measured footprint fits ``PrefixFlowConfig.memory_budget_bytes``
    (:mod:`prefixflow.memory.budget`). ``observer``: optional object with
    ``enter(phase)``/``exit(phase)`` called around each phase. All input is validated before any gradient
    changes. Needs ``apply_prefixflow(model)`` first. ``param.grad`` never receives a NaN/inf: a non-finite
    loss or gradient raises :class:`NonFiniteError` and leaves the gradients as before the call
    (:mod:`prefixflow.schedule.grad_guard`). On a pipeline stage (``apply_pp``) every stage calls it with the same group.
    """
    return run_group(
        model, group, GroupShare(), system=system, layout=layout, microbatch=microbatch, loss=loss,
        loss_config=loss_config, observer=observer,
    )  # fmt: skip


def run_group(
    model: nn.Module,
    group: RolloutGroup,
    share: GroupShare,
    *,
    system: str,
    layout: str,
    microbatch,
    loss: str,
    loss_config,
    observer,
) -> GroupStats:
    """The one driver: validate, plan the microbatches, then run the phases under the phase clock, the
    non-finite guard and the schedule hooks, and build the stats. ``share``: the part of ``group`` this rank
    trains (:class:`GroupShare`)."""
    run = group_run(
        model, group, share, system=system, layout=layout, microbatch=microbatch, loss=loss,
        loss_config=loss_config,
    )  # fmt: skip
    runtime, hooks, group = run.runtime, run.hooks, run.group
    clock = PhaseClock(run.device, observer)
    cache = offload = None
    try:
        with keep_grads_on_failure(model), hooks.group(model, group, system), run.stage.running(run):
            if system == "baseline":
                with clock("full"), hooks.phase("full"):
                    value = phase_full(run)
            else:
                if run.tree_plan is not None:
                    cache = tree_phases.NodeCaches(run, runtime.grad_kv_dtype(model))
                else:
                    cache = PrefixKVCache(runtime.grad_kv_dtype(model))
                    if runtime.config.offload and share.computes_prefix():
                        offload = PrefixOffload(model, cache, prefetch=runtime.config.offload_prefetch)
                    cache.view = hooks.prefix_view(model, group.prompt_len - 1) or cache.view
                value = 0.0
                # A flat group is one wave; a tree runs one per Phase-B microbatch, depth-first: the nodes it
                # reads first forward just before it, those no later path reads backward right after it.
                for wave in tree_phases.waves(run) if run.tree_plan is not None else [None]:
                    with run.plan.prefix_window(), clock("A"), hooks.phase("A"):
                        prefix = share.prefix_forward(
                            run, cache, lambda w=wave: phase_a_prefix_forward(run, cache, offload, w)
                        )
                    with clock("B"), hooks.phase("B"):
                        value += phase_b_suffix_microbatches(run, cache, wave)
                    with clock("C"), hooks.phase("C"):
                        share.prefix_backward(
                            run,
                            cache,
                            lambda w=wave, p=prefix: phase_c_prefix_backward(run, cache, p, offload, w),
                        )
            value = hooks.reduce_loss(value)
    finally:
        if cache is not None:
            cache.release()  # drops the prefix graph first, then the pool its saved tensors point into
        if offload is not None:
            offload.release()
    value = run.stage.report_loss(value)
    if run.tree_plan is not None and cache is not None:
        offloaded = cache.offload_stats()  # a tree: one pool per node, summed
    else:
        offloaded = offload.stats if offload is not None else None
    return group_stats(run, share, value, clock.times, offloaded)


def group_run(
    model: nn.Module,
    group: RolloutGroup,
    share: GroupShare | None = None,
    *,
    system: str = "prefixflow",
    layout: str = "padded",
    microbatch: int | str | None = None,
    loss: str = "pg",
    loss_config: dict | LossConfig | None = None,
) -> GroupRun:
    """Validate one call's input (before any gradient changes) and resolve it into the :class:`GroupRun` the
    phase functions take: the group on the model's device, the loss config, the stage, the microbatch plan.
    A group with ``loss_masks`` runs as its tree (``RolloutGroup.as_tree``)."""
    runtime = runtime_of(model)
    group = run_input(group)
    validate_call(model, group, system, layout, microbatch)
    device = next(model.parameters()).device
    group = group.to(device)
    run = GroupRun(model, runtime, group, system, layout, loss, None, runtime.stage, hooks_of(model), device)
    run.loss_data = group
    if isinstance(group, RolloutTree):
        run.tree_plan, run.loss_data = TreePlan(group), group.path_losses()
    run.cfg = resolve_loss(loss, loss_config, run.loss_data)
    per_response = {
        "importance_sampling='sequence'": run.cfg.importance_sampling == "sequence",
        "policy='vespo'": run.cfg.policy == "vespo",
        "off_policy_threshold": run.cfg.off_policy_threshold is not None,
    }
    for option, used in per_response.items():
        if used and run.hooks.shards_sequences:
            raise ValueError(
                f"loss_config.{option} needs each response's tokens on one rank; "
                "context parallelism spreads them over the CP group (use 'token')"
            )
    paths = (share or GroupShare()).responses(group)
    if run.tree_plan is not None and system != "baseline":  # depth-first; the rest have no leaf row to run
        mine = set(paths)
        paths = [i for i in run.tree_plan.dfs_paths if i in mine and i in run.tree_plan.leaf_rows]
    run.plan = _plan(run, paths, microbatch)
    return run


def _plan(run: GroupRun, responses: list[int], microbatch):
    """The microbatch plan over ``responses``: fixed sizes, or ``"auto"``: sized to
    ``PrefixFlowConfig.memory_budget_bytes``."""
    if microbatch != AUTO:
        return FixedPlan(responses, microbatch)
    budget = run.runtime.config.memory_budget_bytes
    if run.tree_plan is not None:  # each path's Phase-B row (its leaf; the baseline: the whole path)
        plan = run.tree_plan
        row = plan.full_row if run.system == "baseline" else plan.leaf_rows.__getitem__
        lengths = [len(row(i).tokens) for i in responses]
        return BudgetPlan(run.model, lengths, run.layout, budget, ids=responses)
    if responses != list(range(run.group.n)):
        raise ValueError(
            "microbatch='auto' sizes a whole group's microbatches; pass an int for a group's part"
        )
    lead = run.group.prompt_len if run.system == "baseline" else 1  # input tokens before each response's own
    lengths = [lead + s - 1 for s in run.group.response_lens]
    return BudgetPlan(run.model, lengths, run.layout, budget)
