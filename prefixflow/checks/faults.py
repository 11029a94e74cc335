"""Injected faults: schedule hooks that break PrefixFlow on purpose, for negative controls and tests.

A correctness check is only evidence if it can fail. Each fault here is a :class:`~prefixflow.hooks.ScheduleHooks`
object registered with :func:`prefixflow.add_hooks` on a PrefixFlow copy; the phases themselves carry no
fault code. Table 3's negative-control rows (:mod:`prefixflow.checks.alignment`) and the tests use them; nothing
else should.

- :class:`ScalePrefixGradient` ``(factor)``: the prefix gradient Phase C delivers is scaled by ``factor``.
  Phase C's backward is linear in the gK/gV it is seeded with (Proposition 3.1), so scaling its contribution
  to ``param.grad`` is exactly scaling gK/gV. ``factor=0`` is "Phase C off".
- :class:`ShiftSuffixPositions` ``(offset)``: suffix tokens get RoPE positions ``offset`` past where they
  belong (an off-by-one at the cache boundary).
- :class:`MicrobatchLossScale`: each suffix microbatch's loss is normalised by its own number of responses
  instead of the group's ``N`` (the per-microbatch renormalisation trap): its policy loss and gradient are
  scaled by ``N / b``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..hooks import ScheduleHooks

__all__ = ["FAULTS", "ScalePrefixGradient", "ShiftSuffixPositions", "MicrobatchLossScale", "make_fault"]


class _PrefixFlowOnly(ScheduleHooks):
    """A fault that only acts on ``system="prefixflow"`` groups (the baseline copy stays correct)."""

    def __init__(self) -> None:
        self.model: nn.Module | None = None
        self.group_obj = None
        self.active = False
        self.in_b = False  # Phase B is running: the microbatches are leaf (suffix) rows

    @contextlib.contextmanager
    def group(self, model, group, system) -> Iterator[None]:
        self.model, self.group_obj, self.active = model, group, system == "prefixflow"
        try:
            yield
        finally:
            self.model, self.group_obj, self.active = None, None, False

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.in_b = name == "B"
        try:
            yield
        finally:
            self.in_b = False


class ScalePrefixGradient(_PrefixFlowOnly):
    """Phase C's contribution to every ``param.grad`` is multiplied by ``factor`` (= gK/gV scaled)."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = float(factor)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name != "C" or not self.active:
            yield
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        before = [None if p.grad is None else p.grad.detach().clone() for p in params]
        yield
        with torch.no_grad():
            for p, b in zip(params, before, strict=True):
                if p.grad is None:
                    continue
                if b is None:
                    p.grad.mul_(self.factor)
                else:
                    p.grad.copy_(b + self.factor * (p.grad - b))


class ShiftSuffixPositions(_PrefixFlowOnly):
    """Suffix microbatches read RoPE positions ``offset`` too far (the cached prefix is untouched)."""

    def __init__(self, offset: int = 1) -> None:
        super().__init__()
        self.offset = int(offset)

    @contextlib.contextmanager
    def microbatch(self, mb) -> Iterator[None]:
        if not self.active or not self.in_b:
            yield
            return
        original = mb.positions
        if original is None:  # positions 0 .. L-1 (a one-token prompt: nothing cached)
            mb.positions = torch.arange(mb.tokens.shape[1], device=mb.tokens.device).unsqueeze(0)
        mb.positions = mb.positions + self.offset
        try:
            yield
        finally:
            mb.positions = original


class MicrobatchLossScale(_PrefixFlowOnly):
    """Each suffix microbatch's policy loss is scaled by ``N / b``: normalised per microbatch, not per group."""

    @contextlib.contextmanager
    def microbatch(self, mb) -> Iterator[None]:
        group = self.group_obj
        if not self.active or group is None or not self.in_b:
            yield
            return
        advantages = group.advantages  # the tensor the loss reads (the tree's, shared with its PathLosses)
        original = advantages.clone()
        scale = torch.ones_like(original)
        scale[list(mb.responses)] = group.n / len(mb.responses)
        advantages.mul_(scale)
        try:
            yield
        finally:
            advantages.copy_(original)


FAULTS = {
    "phase_c_off": lambda: ScalePrefixGradient(0.0),
    "gkv_x0.9": lambda: ScalePrefixGradient(0.9),
    "rope_offset+1": lambda: ShiftSuffixPositions(1),
    "microbatch_loss_scale": MicrobatchLossScale,
}


def make_fault(name: str) -> ScheduleHooks:
    """A fresh fault hook by its control name (see :data:`FAULTS`)."""
    try:
        return FAULTS[name]()
    except KeyError:
        raise ValueError(f"unknown fault {name!r}; valid: {sorted(FAULTS)}") from None
