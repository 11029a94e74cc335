"""Where one rank's part of each phase runs: :class:`Stage`, the whole model on this device.

The driver (:mod:`prefixflow.schedule`) decides *what* runs in each phase; a stage decides *how* the model's
forward and backward run for it. This default runs every layer here. A pipeline stage
(:mod:`prefixflow.parallel.pp_stage`) runs only its slice of the layers, exchanges activations with its
neighbours and orders the microbatches 1F1B; ``apply_pp`` puts it on the model's runtime. Both run the same
microbatch objective (:func:`microbatch_objective`), so the LM head, the loss, the hooks' extra losses and the
non-finite check are one piece of code.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..loss import microbatch_loss, token_logprobs
from ..model.adapters import adapter_for
from .grad_guard import check_finite_loss

if TYPE_CHECKING:
    from ..state.kv_cache import PrefixKVCache
    from ..tree.layouts import Microbatch

__all__ = [
    "Stage",
    "forward_hidden",
    "loss_logprobs",
    "microbatch_objective",
    "logprob_objective",
    "attention_mode",
]


def forward_hidden(
    model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor | None, *, final_norm=True
):
    """The model's forward without the LM head (embeddings, blocks, final norm), through its adapter."""
    return adapter_for(model).hidden(model, tokens, positions, final_norm=final_norm)


def attention_mode(run, mode):
    """A context in which the model's wrapped attention layers run in ``mode`` (None: the plain forward)."""
    return run.runtime.state.use(mode) if mode is not None else contextlib.nullcontext()


def loss_logprobs(run, mb: Microbatch, hidden: torch.Tensor) -> torch.Tensor:
    """The log-probs of ``mb``'s targets: the model's LM head (its adapter's) at the loss positions only."""
    logits = adapter_for(run.model).lm_head(run.model)(hidden[mb.loss_rows, mb.loss_cols])
    return token_logprobs(logits, mb.targets, run.cfg.temperature)


def microbatch_objective(run, mb: Microbatch, hidden: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The LM head at the loss positions only, the group-weighted loss and the hooks' extra losses (e.g. an
    MoE balance loss, not part of the reported loss). Returns (reported loss, objective to backpropagate);
    a non-finite objective raises :class:`~prefixflow.NonFiniteError` before its backward."""
    return logprob_objective(run, mb, loss_logprobs(run, mb, hidden))


def logprob_objective(run, mb: Microbatch, logp: torch.Tensor) -> tuple[float, torch.Tensor]:
    """:func:`microbatch_objective` from the log-probs of ``mb``'s loss positions; a tree's microbatch
    joins the log-probs its paths' ancestors scored (``mb.shared_logprobs``)."""
    if mb.shared_logprobs is not None:
        shared, paths, slots = mb.shared_logprobs
        logp = torch.cat([logp, shared.to(logp.dtype)])
        mb = dataclasses.replace(
            mb, response_ids=torch.cat([mb.response_ids, paths]), token_ids=torch.cat([mb.token_ids, slots])
        )
    value = microbatch_loss(logp, mb, run.loss_data, run.loss, run.cfg)
    extra = run.hooks.extra_loss()
    objective = value if extra is None else value + extra
    check_finite_loss(objective, f"the microbatch of responses {list(mb.responses)}", run.model)
    return value.item(), objective


class Stage:
    """The whole model on this device: every method runs its part of a phase here, in order."""

    #: Whether this stage holds the last layers, the LM head and the loss (Phase A may stop at the last K/V).
    holds_loss = True

    def check(self, model: nn.Module, system: str, microbatch) -> None:
        """Refuse (``ValueError``) what this stage cannot run, before any gradient changes."""
        return None

    def running(self, run):
        """A context around one group's phases (a pipeline synchronises its stages here)."""
        return contextlib.nullcontext()

    def prefix_forward(self, run, mb: Microbatch) -> None:
        """Phase A's forward of the prefix microbatch (the caller set the capture mode)."""
        forward_hidden(run.model, mb.tokens, mb.positions, final_norm=False)

    def microbatches(self, run, build: Callable[[list[int]], tuple], chunks=None) -> float:
        """Forward, objective and backward of every microbatch of ``run.plan`` (or of ``chunks``: ``(index in
        the plan, responses)`` pairs, a prefix tree's wave); ``build(chunk)`` lays out one and returns
        ``(microbatch, attention mode)``. Returns the summed loss."""
        total = 0.0
        for index, chunk in enumerate(run.plan) if chunks is None else chunks:
            with run.plan.measure(index):
                mb, mode = build(chunk)
                with attention_mode(run, mode), run.hooks.microbatch(mb):
                    hidden = forward_hidden(run.model, mb.tokens, mb.positions)
                    value, objective = microbatch_objective(run, mb, hidden)
                    objective.backward()
                total += value
        return total

    def prefix_backward(self, run, cache: PrefixKVCache) -> None:
        """Phase C's backward through the retained prefix graph, seeded with the accumulated gK/gV."""
        cache.backward_prefix()

    def report_loss(self, value: float) -> float:
        """The group loss every stage reports."""
        return value

    def stats(self) -> dict[str, float]:
        """This stage's counters of the last group (``GroupStats.hooks``)."""
        return {}
