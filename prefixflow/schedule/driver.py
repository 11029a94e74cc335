"""``train_group``: the one driver of the three-phase PrefixFlow schedule and of the full-sequence baseline.

Both systems share the model, the layouts, the loss and the LM-head placement (only at positions that
predict a trained token); they differ only in the schedule:

- baseline:  for each microbatch of full sequences: forward, loss, backward (``path_microbatches``).
- PrefixFlow: per wave, ``node_forwards`` (Phase A: each cached node forward once), ``leaf_microbatches``
  (Phase B: the leaf rows read the caches and accumulate gK/gV), ``node_backwards`` (Phase C: each cached
  node's one delayed backward) (:mod:`prefixflow.schedule.phases`).

Every input runs as a tree: a flat ``RolloutGroup`` as its one-cached-node tree
(:func:`~prefixflow.tree.plan.group_tree`), a ``RolloutTree`` as it is. What differs between shapes enters as
objects, never as a branch of a phase:
- *where* the model runs: the runtime's :class:`~prefixflow.schedule.stage.Stage` (one device; a pipeline
  stage, set by ``apply_pp``, runs its slice of the layers 1F1B);
- *which part of the group* this rank trains: a :class:`GroupShare` (the whole group; a split group's part,
  ``prefixflow.parallel.dp_split``, which receives the prefix K/V instead of computing them);
- parallelism and MoE: the model's schedule hooks (:mod:`prefixflow.hooks`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..group import RolloutGroup
from ..hooks import HookChain, ScheduleHooks, hooks_of
from ..loss import LossConfig, resolve_loss
from ..memory.budget import AUTO, BudgetChunks, FixedChunks
from ..runtime import runtime_of, unwrapped
from ..tree.plan import TreeRows, group_tree
from ..tree.rollout_tree import RolloutTree
from .caches import NodeCaches
from .grad_guard import keep_grads_on_failure
from .host import on_host
from .phases import leaf_microbatches, node_backwards, node_forwards, path_microbatches, waves
from .run import GroupRun, Scores
from .stage import Stage
from .stats import GroupStats, PhaseClock, group_stats
from .validation import SYSTEMS, check_group, validate_call

ONE_DEVICE = Stage()  # the stage of a model no pipeline cut: every layer here (it keeps no state)

__all__ = ["SYSTEMS", "GroupShare", "GroupStats", "check_group", "score_group", "train_group", "train_share"]


class GroupShare:
    """The part of a group this rank trains: here, all of it. ``prefix_forward``/``prefix_backward`` wrap a
    wave's Phase A/C (``compute``); a split group's part overrides them to exchange the prefix K/V."""

    def paths(self, n: int) -> list[int]:
        return list(range(n))

    def computes_prefix(self) -> bool:
        return True

    def prefix_forward(self, run: GroupRun, caches: NodeCaches, compute) -> None:
        compute()

    def prefix_backward(self, run: GroupRun, caches: NodeCaches, compute) -> None:
        compute()


def train_group(
    model: nn.Module,
    group: RolloutGroup | RolloutTree,
    *,
    system: str = "prefixflow",
    layout: str = "padded",
    microbatch: int | str | None = None,
    loss: str = "pg",
    loss_config: dict | LossConfig | None = None,
    observer=None,
) -> GroupStats:
    """Train one rollout group or prefix tree: accumulate its gradients into ``param.grad`` (no zeroing, no
    optimizer step).

    ``system``: ``"prefixflow"`` (three phases) or ``"baseline"`` (full sequences); ``layout``: ``"padded"`` or
    ``"packed"``; ``microbatch``: responses (paths) per microbatch (None = all), or ``"auto"``: the largest
    microbatches whose measured footprint fits ``PrefixFlowConfig.memory_budget_bytes``
    (:mod:`prefixflow.memory.budget`). ``observer``: optional object with ``enter(phase)``/``exit(phase)``
    called around each phase. All input is validated before any gradient changes. Needs
    ``apply_prefixflow(model)`` first. ``param.grad`` never receives a NaN/inf: a non-finite loss or gradient
    raises :class:`NonFiniteError` and leaves the gradients as before the call
    (:mod:`prefixflow.schedule.grad_guard`). On a pipeline stage (``apply_pp``) every stage calls it with the
    same group.
    """
    return train_share(
        model, group, GroupShare(), system=system, layout=layout, microbatch=microbatch, loss=loss,
        loss_config=loss_config, observer=observer,
    )  # fmt: skip


def train_share(
    model: nn.Module,
    group: RolloutGroup | RolloutTree,
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
    model = unwrapped(model)  # torch.compile's and PEFT's wrappers: the phases run the module they wrap
    run = resolve(model, group, share, system=system, layout=layout, microbatch=microbatch, loss=loss,
                  loss_config=loss_config)  # fmt: skip
    clock = PhaseClock(run.device, observer)
    try:
        with keep_grads_on_failure(model), run.hooks.group(model, run.tree, system), run.stage.running(run):
            value = run.hooks.reduce_loss(_run_phases(run, share, clock, train=True))
    finally:
        if run.caches is not None:
            run.caches.release()  # drops each node's graph first, then the pool its saved tensors point into
    value = run.stage.report_loss(value)
    offloaded = run.caches.offload_stats() if run.caches is not None else None
    return group_stats(run, share, value, clock.times, offloaded, tree=isinstance(group, RolloutTree))


def _run_phases(run: GroupRun, share: GroupShare, clock: PhaseClock, *, train: bool) -> float:
    """The baseline's one phase, or PrefixFlow's waves (a flat group is one): the nodes a wave reads first
    forward just before it, those no later path reads backward right after it."""
    hooks = run.hooks
    if run.system == "baseline":
        with clock("full"), hooks.phase("full"):
            return path_microbatches(run)
    run.caches = caches = NodeCaches(run, offload=run.runtime.config.offload and share.computes_prefix())
    value = 0.0
    for wave in waves(run):
        with run.chunks.prefix_window(), clock("A"), hooks.phase("A"):
            share.prefix_forward(run, caches, lambda w=wave: node_forwards(run, caches, w))
        with clock("B"), hooks.phase("B"):
            value += leaf_microbatches(run, caches, wave)
        if not train:
            for j in wave.backward:
                caches.drop(j)
            continue
        with clock("C"), hooks.phase("C"):
            share.prefix_backward(run, caches, lambda w=wave: node_backwards(run, caches, w))
    return value


@torch.no_grad()
def score_group(
    model: nn.Module,
    group: RolloutGroup | RolloutTree,
    *,
    system: str = "prefixflow",
    layout: str = "padded",
    microbatch: int | None = None,
    temperature: float = 1.0,
    hooks: list[ScheduleHooks] = (),
) -> list[torch.Tensor]:
    """The per-token log-probs of each path's trained tokens (a group: each response's tokens) under
    ``model``, forward only, through the same phases and LM-head placement as training (``system``:
    ``"prefixflow"`` forwards each cached node once, ``"baseline"`` every full sequence). No gradient is
    touched. The model's registered hooks do not enter (no sharding: each rank scores its whole group; no
    routing replay or load counting); their ``forward_only`` contexts wrap the call. ``hooks``: the schedule
    hooks of this call (e.g. ``record_routing``'s recorder)."""
    model = unwrapped(model)
    if runtime_of(model).stage is not None:
        raise ValueError(
            "score_group runs the whole model on one process; a pipeline stage cannot score alone"
        )
    loss_config = None if temperature == 1.0 else {"temperature": temperature}
    chain = HookChain()
    chain.hooks = list(hooks)
    run = resolve(model, group, GroupShare(), system=system, layout=layout, microbatch=microbatch, loss="pg",
                  loss_config=loss_config, hooks=chain)  # fmt: skip
    run.scores = Scores(run.loss_data.response_lens)
    try:
        with hooks_of(model).forward_only(), chain.group(model, run.tree, system), run.stage.running(run):
            _run_phases(run, GroupShare(), PhaseClock(run.device, None), train=False)
    finally:
        if run.caches is not None:
            run.caches.release()
    return run.scores.logprobs


def resolve(
    model: nn.Module,
    group: RolloutGroup | RolloutTree,
    share: GroupShare | None = None,
    *,
    system: str = "prefixflow",
    layout: str = "padded",
    microbatch: int | str | None = None,
    loss: str = "pg",
    loss_config: dict | LossConfig | None = None,
    hooks: HookChain | None = None,
) -> GroupRun:
    """Validate one call's input (before any gradient changes) and resolve it into the :class:`GroupRun` the
    phase functions take: the tree that runs (a flat group's :func:`group_tree`) on the model's device, its
    rows, the loss config, the stage, this rank's microbatches. ``hooks``: the call's schedule hooks (default:
    the model's)."""
    runtime = runtime_of(model)
    hooks = hooks_of(model) if hooks is None else hooks
    device = next(model.parameters()).device
    with on_host():  # the caller's tensors, real even under an estimate's fake tensors (.host)
        validate_call(model, group, system, layout, microbatch, hooks)
        host = group_tree(group) if isinstance(group, RolloutGroup) else group
        tree = host.to(device)
        losses = tree.path_losses()
        cfg = resolve_loss(loss, loss_config, losses)
        rows = TreeRows(host)
    stage = runtime.stage or ONE_DEVICE
    run = GroupRun(model, runtime, tree, rows, system, layout, loss, cfg, stage, hooks, device,
                   losses)  # fmt: skip
    per_response = {
        "importance_sampling='sequence'": cfg.importance_sampling == "sequence",
        "policy='vespo'": cfg.policy == "vespo",
        "off_policy_threshold": cfg.off_policy_threshold is not None,
    }
    for option, used in per_response.items():
        if used and hooks.shards_sequences:
            raise ValueError(
                f"loss_config.{option} needs each response's tokens on one rank; "
                "context parallelism spreads them over the CP group (use 'token')"
            )
    if tree.path_inputs is not None:
        if runtime.stage is not None or hooks.shards_sequences:
            raise ValueError(
                "multimodal inputs (prompt_inputs / path_inputs) train on one device or under data parallelism; "
                "pipeline stages and context parallelism do not carry them yet"
            )
        run.inputs = runtime.adapter.prepare_inputs(model, tree)
    run.masks = runtime.adapter.mask_rules(model, tree, run.inputs)
    if run.masks is not None and (runtime.stage is not None or hooks.shards_sequences):
        raise ValueError(
            "this group needs sliding-window or bidirectional attention masks, which pipeline stages and context "
            "parallelism do not carry yet; shorten the group below the window"
        )
    share = share or GroupShare()
    paths = share.paths(tree.n)
    run.paths, run.computes_prefix = frozenset(paths), share.computes_prefix()
    if system != "baseline":  # depth-first; the rest have no leaf row to run
        paths = [i for i in run.rows.dfs_paths if i in run.paths and i in run.rows.leaf_rows]
    run.chunks = _chunks(run, paths, microbatch)
    return run


def _chunks(run: GroupRun, paths: list[int], microbatch):
    """The microbatches over ``paths``: fixed sizes, or ``"auto"``: sized to
    ``PrefixFlowConfig.memory_budget_bytes`` from each path's row (its leaf row; the baseline: the path)."""
    if microbatch != AUTO:
        return FixedChunks(paths, microbatch)
    row = run.rows.full_row if run.system == "baseline" else run.rows.leaf_rows.__getitem__
    lengths = [len(row(i)) for i in paths]
    return BudgetChunks(run.model, lengths, run.layout, run.runtime.config.memory_budget_bytes, ids=paths)
