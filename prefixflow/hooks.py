"""Extension points of the schedule: how parallelism and MoE enter the three phases.

The phases in :mod:`prefixflow.schedule` stay three short functions. Whatever changes *where* work runs
(FSDP's gradient sync, context-parallel gathers, routing replay, ...) is a :class:`ScheduleHooks` object
registered on the model with :func:`add_hooks`; the schedule enters the registered hooks around the whole
group, around each phase and around each microbatch, for both systems. A hook never changes the math: the
baseline and PrefixFlow run the same hooks, so they differ only in the schedule.

Order: hooks are entered in registration order and exited in reverse (a stack), so the hook that an
``apply_*`` function registers first wraps everything registered after it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from .runtime import runtime_of

if TYPE_CHECKING:
    from .group import RolloutGroup
    from .state.kv_cache import PrefixView
    from .tree.layouts import Microbatch

__all__ = ["ScheduleHooks", "HookChain", "add_hooks", "remove_hooks", "hooks_of"]

PHASES = ("A", "B", "C", "full")  # "full" is the baseline's single phase


class ScheduleHooks:
    """Base class: every method is a no-op. Override the ones a feature needs.

    - ``check(model, group, system)``: validate the input (raise ``ValueError`` naming the field) before any
      gradient changes.
    - ``group(model, group, system)``: a context around one whole ``train_group`` call (after validation).
      Its exit runs on success and on error: undo every state the hook set up.
    - ``phase(name)``: a context around each phase, ``"A"``, ``"B"``, ``"C"`` (PrefixFlow) or ``"full"``
      (baseline).
    - ``microbatch(mb)``: a context around one microbatch's work: a cached node's Phase-A forward and its
      Phase-C backward (``mb.rows``: its row), a Phase-B microbatch of leaf rows, a baseline microbatch.
    - ``prefix_backward()``: a context around each cached node's delayed backward (a flat group's one;
      children before parents in a tree).
    - ``extra_loss()``: a scalar the hook's modules added to the objective during the forward since the last
      call (e.g. an MoE balance loss), or None. The schedule adds it to each microbatch's loss before its
      backward; what Phase A produced joins Phase C's prefix backward.
    - ``full_prefix_forward()``: True when Phase A must run every block to its end instead of stopping at
      the last layer's K/V (the hook reads prefix work past them).
    - ``forward_only()``: a context around a forward with no backward after it (policy evaluation, e.g.
      ``prefixflow.rl.response_logprobs``); its exit leaves the model as a finished step would (FSDP2:
      every unit resharded, no per-iteration state left).

    Where the work of a microbatch runs (context parallelism, say) enters through three more methods:

    - ``shard(mb)``: the part of a microbatch (Phase A's prefix, a suffix microbatch, a baseline microbatch)
      that this rank computes; it may set ``mb.sequence``, which gathers the K/V of the tokens other ranks hold.
    - ``prefix_view(model, length)``: how each layer's attention reads the full K/V of a cached run of
      ``length`` tokens (a flat group's prefix; each node of a prefix tree) and where gK/gV go back (a
      :class:`~prefixflow.state.kv_cache.PrefixView`; ``None`` = the cache's own leaves).
    - ``reduce_loss(value)``: the group loss every rank reports, from this rank's share.

    ``stats()`` returns counters of the last group; they land in ``GroupStats.hooks``. Every call runs a tree
    (a flat group is its one-cached-node tree), so a hook sees the same calls for both. ``shards_sequences``: whether ``shard`` spreads a sequence's tokens over ranks (a loss that needs a whole
    response on one rank is then refused before any work).
    """

    shards_sequences = False

    def check(self, model: nn.Module, group: RolloutGroup, system: str) -> None:
        return None

    def group(self, model: nn.Module, group: RolloutGroup, system: str):
        return contextlib.nullcontext()

    def phase(self, name: str):
        return contextlib.nullcontext()

    def microbatch(self, mb: Microbatch):
        return contextlib.nullcontext()

    def prefix_backward(self):
        return contextlib.nullcontext()

    def extra_loss(self) -> torch.Tensor | None:
        return None

    def full_prefix_forward(self) -> bool:
        return False

    def forward_only(self):
        return contextlib.nullcontext()

    def shard(self, mb: Microbatch) -> Microbatch:
        return mb

    def prefix_view(self, model: nn.Module, length: int) -> PrefixView | None:
        return None

    def reduce_loss(self, value: float) -> float:
        return value

    def stats(self) -> dict[str, float]:
        return {}


class HookChain:
    """The registered hooks of one model, entered as one context (registration order, exited in reverse)."""

    def __init__(self) -> None:
        self.hooks: list[ScheduleHooks] = []

    def __len__(self) -> int:
        return len(self.hooks)

    def check(self, model: nn.Module, group: RolloutGroup, system: str) -> None:
        for hook in self.hooks:
            hook.check(model, group, system)

    @contextlib.contextmanager
    def _enter(self, method: str, *args) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for hook in self.hooks:
                stack.enter_context(getattr(hook, method)(*args))
            yield

    def group(self, model: nn.Module, group: RolloutGroup, system: str):
        return self._enter("group", model, group, system)

    def phase(self, name: str):
        if name not in PHASES:
            raise ValueError(f"phase {name!r} unknown; valid: {PHASES}")
        return self._enter("phase", name)

    def microbatch(self, mb: Microbatch):
        return self._enter("microbatch", mb)

    def prefix_backward(self):
        return self._enter("prefix_backward")

    def forward_only(self):
        return self._enter("forward_only")

    def extra_loss(self) -> torch.Tensor | None:
        """The sum of every hook's ``extra_loss()`` (None when none has one)."""
        terms = [t for t in (hook.extra_loss() for hook in self.hooks) if t is not None]
        return torch.stack(terms).sum() if terms else None

    def full_prefix_forward(self) -> bool:
        return any(hook.full_prefix_forward() for hook in self.hooks)

    @property
    def shards_sequences(self) -> bool:
        return any(hook.shards_sequences for hook in self.hooks)

    def shard(self, mb: Microbatch) -> Microbatch:
        for hook in self.hooks:
            mb = hook.shard(mb)
        return mb

    def prefix_view(self, model: nn.Module, length: int) -> PrefixView | None:
        views = [(h, v) for h in self.hooks if (v := h.prefix_view(model, length)) is not None]
        if len(views) > 1:
            names = [type(h).__name__ for h, _ in views]
            raise ValueError(f"several hooks supply the prefix K/V view ({names}); register only one")
        return views[0][1] if views else None

    def reduce_loss(self, value: float) -> float:
        for hook in self.hooks:
            value = hook.reduce_loss(value)
        return value

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for hook in self.hooks:
            out.update(hook.stats())
        return out


def hooks_of(model: nn.Module) -> HookChain:
    """The model's hook chain (empty until something registers)."""
    runtime = runtime_of(model, create=True)
    if runtime.hooks is None:
        runtime.hooks = HookChain()
    return runtime.hooks


def add_hooks(model: nn.Module, hook: ScheduleHooks) -> ScheduleHooks:
    """Register ``hook`` on ``model``; ``train_group`` enters it from the next call on. Returns it."""
    if not isinstance(hook, ScheduleHooks):
        raise TypeError(f"hook must be a prefixflow.hooks.ScheduleHooks, got {type(hook).__name__}")
    chain = hooks_of(model)
    if any(h is hook for h in chain.hooks):
        raise ValueError(f"{type(hook).__name__} is already registered on this model")
    chain.hooks.append(hook)
    return hook


def remove_hooks(model: nn.Module, hook: ScheduleHooks) -> None:
    """Unregister ``hook`` (a no-op when it is not registered)."""
    chain = hooks_of(model)
    chain.hooks = [h for h in chain.hooks if h is not hook]
