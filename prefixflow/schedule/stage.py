"""Where one rank's part of each phase runs: :class:`Stage`, the whole model on this device.

The phase functions (:mod:`prefixflow.schedule.phases`) decide *what* runs; a stage decides *how* the model's
forward and backward run for it. This default runs every layer here. A pipeline stage
(:mod:`prefixflow.parallel.pp_stage`) runs only its slice of the layers, exchanges activations with its
neighbours and orders the microbatches 1F1B; ``apply_pp`` puts it on the model's runtime. Both run the same
microbatch objective (:func:`microbatch_objective`), so the LM head, the loss, the hooks' extra losses and the
non-finite check are one piece of code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..loss import microbatch_loss, token_logprobs
from ..model.adapters import adapter_for
from .grad_guard import check_finite_loss
from .host import has_values

if TYPE_CHECKING:
    from ..tree.layouts import Microbatch
    from .run import GroupRun

__all__ = [
    "Stage",
    "forward_hidden",
    "forward_rows",
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


def forward_rows(run: GroupRun, mb: Microbatch, *, final_norm=True) -> torch.Tensor:
    """:func:`forward_hidden` of a laid-out microbatch; a multimodal tree's rows go through the adapter's
    ``rows_hidden`` with the call's prepared inputs (images merged, the model's own positions)."""
    if run.inputs is None:
        return forward_hidden(run.model, mb.tokens, mb.positions, final_norm=final_norm)
    return run.runtime.adapter.rows_hidden(run.model, mb, run.inputs, final_norm=final_norm)


def attention_mode(run: GroupRun, mode):
    """A context in which the model's wrapped attention layers run in ``mode`` (None: the plain forward)."""
    return run.runtime.state.use(mode) if mode is not None else contextlib.nullcontext()


def loss_logprobs(run: GroupRun, mb: Microbatch, hidden: torch.Tensor) -> torch.Tensor:
    """The log-probs of ``mb``'s targets: the model's LM head (its adapter's) at the scored positions only."""
    logits = run.runtime.adapter.lm_head(run.model)(hidden[mb.loss_rows, mb.loss_cols])
    return token_logprobs(logits, mb.targets, run.cfg.temperature)


def microbatch_objective(run: GroupRun, mb: Microbatch, hidden: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The LM head at the loss positions only, the group-weighted loss and the hooks' extra losses (e.g. an
    MoE balance loss, not part of the reported loss). Returns (reported loss, objective to backpropagate);
    a non-finite objective raises :class:`~prefixflow.NonFiniteError` before its backward."""
    return logprob_objective(run, mb, loss_logprobs(run, mb, hidden))


def _with_shared(mb: Microbatch, logp: torch.Tensor) -> tuple[Microbatch, torch.Tensor]:
    """``mb``'s scored log-probs joined by those its paths' cached nodes scored (``mb.shared_logprobs``)."""
    if mb.shared_logprobs is None:
        return mb, logp
    shared, paths, slots = mb.shared_logprobs
    logp = torch.cat([logp, shared.to(logp.dtype)])
    mb = dataclasses.replace(
        mb, response_ids=torch.cat([mb.response_ids, paths]), token_ids=torch.cat([mb.token_ids, slots])
    )
    return mb, logp


def logprob_objective(run: GroupRun, mb: Microbatch, logp: torch.Tensor) -> tuple[float, torch.Tensor]:
    """:func:`microbatch_objective` from the log-probs of ``mb``'s loss positions, joined by those its paths'
    cached nodes scored."""
    mb, logp = _with_shared(mb, logp)
    value = microbatch_loss(logp, mb, run.loss_data, run.loss, run.cfg)
    extra = run.hooks.extra_loss()
    objective = value if extra is None else value + extra
    check_finite_loss(objective, f"the microbatch of responses {list(mb.responses)}", run.model)
    return (value.item() if has_values(value) else math.nan), objective  # fake under an estimate


def keep_scores(run: GroupRun, mb: Microbatch, hidden: torch.Tensor) -> None:
    """A forward-only call: the microbatch's log-probs (with its cached nodes') go to ``run.scores``."""
    mb, logp = _with_shared(mb, loss_logprobs(run, mb, hidden))
    run.scores.add(mb.response_ids, mb.token_ids, logp.detach())


class Stage:
    """The whole model on this device: every method runs its part of a phase here, in order."""

    #: Whether this stage holds the last layers, the LM head and the loss (Phase A may stop at the last K/V).
    holds_loss = True

    def check(self, model: nn.Module, system: str, microbatch) -> None:
        """Refuse (``ValueError``) what this stage cannot run, before any gradient changes."""
        return None

    def running(self, run: GroupRun):
        """A context around one call's phases (a pipeline synchronises its stages here)."""
        return contextlib.nullcontext()

    def node_forward(self, run: GroupRun, j: int, mb: Microbatch) -> torch.Tensor | None:
        """Phase A's forward of cached node ``j``'s row (the caller set the attention mode); its hidden states
        where this stage holds the LM head (the node's scores read them), else None."""
        return forward_rows(run, mb, final_norm=run.rows.scores(j) > 0)

    def microbatches(self, run: GroupRun, build: Callable[[list[int]], tuple], chunks=None) -> float:
        """Forward, objective and backward of every microbatch of ``run.chunks`` (or of ``chunks``: ``(index
        in the chunks, paths)`` pairs, a wave's); ``build(chunk)`` lays out one and returns ``(microbatch,
        attention mode)``. Returns the summed loss (a forward-only call keeps the log-probs instead)."""
        total = 0.0
        for index, chunk in enumerate(run.chunks) if chunks is None else chunks:
            with run.chunks.measure(index):
                mb, mode = build(chunk)
                with attention_mode(run, mode), run.hooks.microbatch(mb):
                    hidden = forward_rows(run, mb)
                    if run.scores is not None:
                        keep_scores(run, mb, hidden)
                        continue
                    value, objective = microbatch_objective(run, mb, hidden)
                    objective.backward()
                total += value
        return total

    def node_seeds(self, run: GroupRun, j: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """More seeds of cached node ``j``'s backward (a pipeline stage: its output and the gradient the next
        stage sent back for it); none here."""
        return [], []

    def node_backward_done(self, run: GroupRun, j: int) -> None:
        """After node ``j``'s backward (a pipeline stage sends its input's gradient back)."""
        return None

    def report_loss(self, value: float) -> float:
        """The group loss every stage reports."""
        return value

    def stats(self) -> dict[str, float]:
        """This stage's counters of the last group (``GroupStats.hooks``)."""
        return {}
