"""``train_group``: the three-phase PrefixFlow schedule and the full-sequence baseline.

Both systems share the model, the layouts, the loss and the LM-head placement (only at positions that
predict a response token); they differ only in the schedule:

- baseline:  for each microbatch of ``[P || S_i]`` sequences: forward, loss, backward.
- PrefixFlow: ``phase_a_prefix_forward`` (cache K/V of ``P[:-1]`` once), ``phase_b_suffix_microbatches``
  (suffixes read the cache and accumulate gK/gV), ``phase_c_prefix_backward`` (one delayed prefix backward).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from .adapters import adapter_for
from .apply import PrefixFlowRuntime, runtime_of
from .attention import AttendWithPrefix, CapturePrefix, MaskedAttention, PrefixCaptured
from .budget import AUTO, BudgetPlan, FixedPlan
from .compile import is_compiled
from .grad_guard import check_finite_loss, keep_grads_on_failure
from .group import RolloutGroup
from .hooks import hooks_of
from .kv_cache import PrefixKVCache
from .layouts import (
    LAYOUTS,
    Microbatch,
    build_microbatch,
    full_sequence_segments,
    prefix_microbatch,
    suffix_segments,
)
from .loss import LossConfig, microbatch_loss, resolve_loss, token_logprobs
from .offload import OffloadStats, PrefixOffload, offloading

__all__ = [
    "SYSTEMS",
    "GroupStats",
    "train_group",
    "check_group",
    "phase_a_prefix_forward",
    "phase_b_suffix_microbatches",
    "phase_c_prefix_backward",
    "forward_hidden",
]

SYSTEMS = ("prefixflow", "baseline")


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
        None  # microbatch="auto": budget, measured footprint, chosen sizes (prefixflow.budget)
    )

    @property
    def total_s(self) -> float:
        return sum(self.phase_times.values())


def forward_hidden(
    model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor | None, *, final_norm=True
):
    """The model's forward without the LM head (embeddings, blocks, final norm), through its adapter."""
    return adapter_for(model).hidden(model, tokens, positions, final_norm=final_norm)


def _forward_backward(model, mb: Microbatch, group, loss: str, cfg: LossConfig) -> float:
    """One microbatch: forward, LM head at loss positions only, group-weighted loss, backward.
    The model's schedule hooks (:mod:`prefixflow.hooks`) wrap it."""
    hooks = hooks_of(model)
    with hooks.microbatch(mb):
        hidden = forward_hidden(model, mb.tokens, mb.positions)
        logits = adapter_for(model).lm_head(model)(hidden[mb.loss_rows, mb.loss_cols])
        value = microbatch_loss(token_logprobs(logits, mb.targets, cfg.temperature), mb, group, loss, cfg)
        extra = hooks.extra_loss()  # e.g. an MoE balance loss; not part of the reported loss
        total = value if extra is None else value + extra
        check_finite_loss(total, f"the microbatch of responses {list(mb.responses)}", model)
        total.backward()
    return value.item()


def phase_a_prefix_forward(
    model: nn.Module,
    runtime: PrefixFlowRuntime,
    group: RolloutGroup,
    cache,
    offload: PrefixOffload | None = None,
) -> Microbatch | None:
    """Phase A: run the shared prefix ``P[:-1]`` forward once; each layer leaves its live K/V in ``cache``.
    With ``offload``, the other tensors the prefix graph saves move out of device memory as they are saved.
    Loss terms the hooks add during this forward (``extra_loss``) join Phase C's backward.
    Returns the prefix microbatch this rank ran (Phase C recomputes under its attention), None if empty."""
    if group.prompt_len == 1:
        return None  # one-token prompt: nothing to cache, suffixes start at position 0
    mb = hooks_of(model).shard(prefix_microbatch(group, group.prompt.device))
    mode = CapturePrefix(cache, _last_needed_layer(model, runtime), mask=mb.mask, sequence=mb.sequence)
    with runtime.state.use(mode), offloading(offload):
        try:
            forward_hidden(model, mb.tokens, mb.positions, final_norm=False)
        except PrefixCaptured:
            pass  # the last layer's K/V are in the cache; the rest of the prefix forward is dead work
    cache.add_prefix_loss(hooks_of(model).extra_loss())
    return mb


def _last_needed_layer(model: nn.Module, runtime: PrefixFlowRuntime) -> int | None:
    """The layer after whose K/V Phase A may stop, or None to run the whole forward.

    A checkpointed last block runs to its end: its recomputation in Phase C must save exactly what the
    original forward saved. So does every block when a schedule hook reads prefix work past the last K/V.
    """
    adapter = runtime.adapter
    if adapter.block_is_checkpointed(adapter.blocks(model)[-1]) or hooks_of(model).full_prefix_forward():
        return None
    return runtime.n_wrapped - 1


def phase_b_suffix_microbatches(
    model, runtime: PrefixFlowRuntime, group, cache, plan, layout: str, loss: str, cfg: LossConfig
) -> float:
    """Phase B: train the suffixes as ordinary microbatches reading the cache; returns the group loss.
    ``plan`` yields each microbatch's responses (:mod:`prefixflow.budget`: fixed sizes, or sized to a budget)."""
    segments = suffix_segments(group)
    device = group.prompt.device
    variant = runtime.config.attention_for(device)
    total = 0.0
    for index, chunk in enumerate(plan):
        with plan.measure(index):
            mb = _microbatch(model, group, [segments[i] for i in chunk], layout, group.prompt_len - 1)
            mode = AttendWithPrefix(
                cache, mb.mask, variant, sequence=mb.sequence, causal_suffix=mb.causal_suffix
            )
            with runtime.state.use(mode):
                total += _forward_backward(model, mb, group, loss, cfg)
    return total


def _microbatch(model, group, segments, layout: str, cached_prefix_len: int | None) -> Microbatch:
    """Lay out ``segments``; the schedule hooks keep the part this rank computes (``ScheduleHooks.shard``)."""
    mb = build_microbatch(
        group, segments, layout, cached_prefix_len=cached_prefix_len, device=group.prompt.device
    )
    return hooks_of(model).shard(mb)


def phase_c_prefix_backward(
    cache: PrefixKVCache,
    offload: PrefixOffload | None = None,
    *,
    runtime: PrefixFlowRuntime | None = None,
    prefix: Microbatch | None = None,
) -> None:
    """Phase C: inject the accumulated gK/gV into the retained prefix graph; one prefix backward.
    With ``offload``, its saved tensors are prefetched in reverse layer order (or demand-loaded).
    ``runtime``/``prefix``: checkpointed prefix blocks recompute under the prefix's attention (Phase A's
    minus the capture: plain causal, or the sharded prefix's when its tokens are spread over ranks)."""
    if offload is not None:
        offload.prefetch()
    recompute = contextlib.nullcontext()  # unsharded: no mode, the plain forward's causal attention
    if runtime is not None and prefix is not None and prefix.sequence is not None:
        recompute = runtime.state.use(MaskedAttention(prefix.mask, prefix.sequence))
    with recompute:
        cache.backward_prefix()


def _baseline(model, runtime, group, plan, layout, loss, cfg) -> float:
    segments = full_sequence_segments(group)
    total = 0.0
    for index, chunk in enumerate(plan):
        with plan.measure(index):
            mb = _microbatch(model, group, [segments[i] for i in chunk], layout, None)
            mode = MaskedAttention(mb.mask, mb.sequence) if mb.mask is not None else None
            with runtime.state.use(mode) if mode is not None else contextlib.nullcontext():
                total += _forward_backward(model, mb, group, loss, cfg)
    return total


class _PhaseClock:
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
            self.times[phase] = time.perf_counter() - start
            if self.observer is not None:
                self.observer.exit(phase)


def _chunks(n: int, microbatch: int | None) -> list[list[int]]:
    """Fixed microbatches of ``microbatch`` responses (None = all), for schedules without a budget plan."""
    return FixedPlan(n, microbatch).chunks


def _plan(model, runtime, group, system: str, layout: str, microbatch):
    """The microbatch plan: fixed sizes, or ``"auto"``: sized to ``PrefixFlowConfig.memory_budget_bytes``."""
    if microbatch != AUTO:
        return FixedPlan(group.n, microbatch)
    lead = group.prompt_len if system == "baseline" else 1  # input tokens before each response's own
    lengths = [lead + s - 1 for s in group.response_lens]
    return BudgetPlan(model, lengths, layout, runtime.config.memory_budget_bytes)


def _validate(model, group, system, layout, microbatch) -> None:
    if not isinstance(group, RolloutGroup):
        raise TypeError(f"group must be a prefixflow.RolloutGroup, got {type(group).__name__}")
    if system not in SYSTEMS:
        raise ValueError(f"system {system!r} unknown; valid systems: {SYSTEMS}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} unknown; valid layouts: {LAYOUTS}")
    if microbatch == AUTO:
        if runtime_of(model).config.memory_budget_bytes is None:
            raise ValueError(
                "microbatch='auto' needs a memory budget: apply_prefixflow(model, "
                "PrefixFlowConfig(memory_budget_bytes=...)), or pass an int microbatch"
            )
        if is_compiled(model):
            raise ValueError(
                "microbatch='auto' measures memory with a dispatch mode, which compiled blocks cannot run "
                "under; pass an int microbatch with apply_compile"
            )
    elif microbatch is not None and (
        isinstance(microbatch, bool) or not isinstance(microbatch, int) or microbatch < 1
    ):
        raise ValueError(
            f"microbatch must be None (all responses), an int >= 1 or 'auto', got {microbatch!r}"
        )
    adapter = adapter_for(model)
    group.check_fits(adapter.vocab_size(model), adapter.max_seq_len(model))
    group.check_representable(compute_dtype(model))
    adapter.check(model, group)
    if group.routing is not None and getattr(model, "_prefixflow_moe", None) is None:
        raise ValueError("group.routing replays MoE expert choices, but this model has no MoE layers")
    hooks_of(model).check(model, group, system)


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the loss is computed in: the parameters' dtype, at least fp32 (see ``token_logprobs``)."""
    return torch.promote_types(next(model.parameters()).dtype, torch.float32)


def check_group(
    model: nn.Module,
    group: RolloutGroup,
    *,
    system: str = "prefixflow",
    layout: str = "padded",
    microbatch: int | str | None = None,
    loss: str = "pg",
    loss_config: dict | LossConfig | None = None,
) -> LossConfig:
    """Everything ``train_group`` validates, without training: raises ``ValueError``/``TypeError`` naming the
    field. Lets a caller validate several groups before the first one changes any gradient."""
    runtime_of(model)
    _validate(model, group, system, layout, microbatch)
    return resolve_loss(loss, loss_config, group)


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
    (:mod:`prefixflow.budget`). ``observer``: optional object with
    ``enter(phase)``/``exit(phase)`` called around each phase. All input is validated before any gradient
    changes. Needs ``apply_prefixflow(model)`` first. ``param.grad`` never receives a NaN/inf: a non-finite
    loss or gradient raises :class:`NonFiniteError` and leaves the gradients as before the call
    (:mod:`prefixflow.grad_guard`).
    """
    pipeline = getattr(model, "_prefixflow_pipeline", None)
    if pipeline is not None:  # a pipeline stage (prefixflow.parallel.pp): the same phases, run per stage
        return pipeline.train_group(
            model,
            group,
            system=system,
            layout=layout,
            microbatch=microbatch,
            loss=loss,
            loss_config=loss_config,
            observer=observer,
        )
    runtime = runtime_of(model)
    _validate(model, group, system, layout, microbatch)
    cfg = resolve_loss(loss, loss_config, group)
    device = next(model.parameters()).device
    group = group.to(device)
    plan = _plan(model, runtime, group, system, layout, microbatch)
    clock = _PhaseClock(device, observer)
    hooks = hooks_of(model)
    suffix_tokens = sum(group.response_lens)
    if system == "baseline":
        with keep_grads_on_failure(model), hooks.group(model, group, system):
            with clock("full"), hooks.phase("full"):
                value = _baseline(model, runtime, group, plan, layout, loss, cfg)
            value = hooks.reduce_loss(value)
        trunk = _trunk_tokens(group, plan.chunks, layout, group.prompt_len)
        return GroupStats(
            system, layout, value, len(plan.chunks), 0, suffix_tokens, trunk, clock.times,
            hooks=hooks.stats(), plan=plan.stats,
        )  # fmt: skip

    cache = PrefixKVCache(runtime.grad_kv_dtype(model))
    config = runtime.config
    offload = PrefixOffload(model, cache, prefetch=config.offload_prefetch) if config.offload else None
    try:
        with keep_grads_on_failure(model), hooks.group(model, group, system):
            cache.view = hooks.prefix_view(model, group) or cache.view
            with plan.prefix_window(), clock("A"), hooks.phase("A"):
                prefix_mb = phase_a_prefix_forward(model, runtime, group, cache, offload)
            with clock("B"), hooks.phase("B"):
                value = phase_b_suffix_microbatches(model, runtime, group, cache, plan, layout, loss, cfg)
            with clock("C"), hooks.phase("C"):
                phase_c_prefix_backward(cache, offload, runtime=runtime, prefix=prefix_mb)
            value = hooks.reduce_loss(value)
    finally:
        cache.release()  # drops the prefix graph first, then the pool its saved tensors point into
        if offload is not None:
            offload.release()
    prefix = group.prompt_len - 1
    trunk = prefix + _trunk_tokens(group, plan.chunks, layout, 1)
    offload_stats = offload.stats if offload is not None else None
    return GroupStats(
        system,
        layout,
        value,
        len(plan.chunks),
        prefix,
        suffix_tokens,
        trunk,
        clock.times,
        offload_stats,
        hooks=hooks.stats(),
        plan=plan.stats,
    )


def _trunk_tokens(group: RolloutGroup, chunks, layout: str, lead: int) -> int:
    """Token slots the trunk runs: each sequence is ``lead`` context tokens + its response minus one."""
    lens = [lead + s - 1 for s in group.response_lens]
    if layout == "packed":
        return sum(lens[i] for c in chunks for i in c)
    return sum(len(c) * max(lens[i] for i in c) for c in chunks)
