"""The trainer-side pieces of a GRPO step: advantages, policy evaluation, the actor update, weight sync.

A synchronous colocated step is ``sample_responses`` (rollout model) -> reward -> ``group_advantages`` ->
``response_logprobs`` (old policy, and reference) -> ``actor_update`` (``train_group`` with ``loss="grpo"``
per group, one optimizer step) -> ``sync_weights`` (actor -> rollout model). Only ``actor_update`` differs
between the full-sequence baseline and PrefixFlow (its ``system``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..group import RolloutGroup
from ..loss import LossConfig
from ..parallel import parallel_state
from ..schedule.driver import score_group, train_group
from ..schedule.grad_guard import keep_grads_on_failure

_AC_PREFIX = "_checkpoint_wrapped_module."

__all__ = [
    "UpdateStats",
    "named_parameters",
    "group_advantages",
    "response_logprobs",
    "actor_update",
    "sync_weights",
    "autocast_for",
]


def autocast_for(device: torch.device, compute_dtype: torch.dtype | None):
    """``torch.autocast`` for mixed precision (fp32 master weights, bf16/fp16 compute), else a no-op."""
    if compute_dtype in (torch.bfloat16, torch.float16):
        return torch.autocast(device.type, dtype=compute_dtype)
    return contextlib.nullcontext()


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6, scale: bool = True) -> torch.Tensor:
    """GRPO's group-normalised advantages ``(r - mean(r)) / (std(r) + eps)`` (std unbiased, as in verl);
    ``scale=False`` keeps ``r - mean(r)``. A group of one response, or of equal rewards, gets zeros."""
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if r.numel() == 0 or not torch.isfinite(r).all():
        raise ValueError("rewards must be a non-empty tensor of finite numbers")
    centred = r - r.mean()
    if not scale or r.numel() == 1:
        return centred if r.numel() > 1 else torch.zeros_like(r)
    return centred / (r.std() + eps)


def response_logprobs(
    model: nn.Module, prompt: torch.Tensor, responses: list[torch.Tensor], *, microbatch: int | None = None
) -> list[torch.Tensor]:
    """Per-token ``log pi(s_it | P, s_<t)`` of each response under ``model`` (fp32): full sequences, forward
    only, the model's LM head at response positions only (policy evaluation; the same for every trainer),
    through the baseline's own phase (:func:`~prefixflow.schedule.driver.score_group`)."""
    probe = RolloutGroup(prompt, list(responses), torch.zeros(len(responses)))
    logprobs = score_group(model, probe, system="baseline", layout="padded", microbatch=microbatch)
    return [t.float() for t in logprobs]


@dataclass
class UpdateStats:
    """One optimizer step over several rollout groups."""

    loss: float  # mean of the groups' losses (all data-parallel ranks' groups)
    grad_norm: float  # total gradient norm before clipping
    suffix_tokens: int  # all data-parallel ranks' groups, as trunk_tokens
    trunk_tokens: int
    phase_times: dict[str, float] = field(default_factory=dict)  # summed over this rank's groups
    optimizer_s: float = 0.0  # gradient averaging, clipping and the optimizer step (wall clock)


def actor_update(
    model: nn.Module,
    groups: list[RolloutGroup],
    optimizer: torch.optim.Optimizer,
    *,
    system: str,
    lr: float | None = None,
    layout: str = "padded",
    microbatch: int | None = None,
    loss_config: dict | LossConfig | None = None,
    max_grad_norm: float | None = None,
    compute_dtype: torch.dtype | None = None,
) -> UpdateStats:
    """One actor update: ``train_group(loss="grpo")`` per group, gradients averaged over the groups (verl's
    ``seq-mean-token-mean`` over the batch), optional norm clipping, one ``optimizer.step()``.

    ``lr`` (if given) is set on every parameter group first; ``compute_dtype`` bf16/fp16 runs the groups
    under autocast (mixed precision over fp32 master weights). Each group is validated by its
    ``train_group`` call; if any call raises (bad input, non-finite loss), or the summed gradient is not
    finite (:class:`prefixflow.NonFiniteError`, checked once for all groups), the gradients and learning
    rates are put back as they were before this call (references kept, no copies) and nothing is stepped.

    On an actor parallelized with ``dp_replicate``/``dp_shard``, every rank passes the same ``groups``: each
    trains its share (``prefixflow.parallel.train_step``), gradients are summed over the ranks once, then
    averaged, clipped and stepped as on one process. ``loss`` and token counts then cover every rank's
    groups, ``phase_times`` this rank's. On a parallel actor the finiteness verdict is every rank's.
    """
    if not groups:
        raise ValueError("actor_update needs at least one rollout group")
    all_params = list(model.parameters())
    grads_before = [p.grad for p in all_params]
    lrs_before = [pg["lr"] for pg in optimizer.param_groups]
    device = all_params[0].device
    try:
        if lr is not None:
            for pg in optimizer.param_groups:
                pg["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        # One finiteness check for the whole update (the guard nests: train_group's own is then a no-op).
        with autocast_for(device, compute_dtype), keep_grads_on_failure(model):
            loss, suffix, trunk, times = _train_groups(model)(
                model, groups, system=system, layout=layout, microbatch=microbatch, loss_config=loss_config
            )
    except BaseException:
        for p, g in zip(all_params, grads_before, strict=True):
            p.grad = g
        for pg, old in zip(optimizer.param_groups, lrs_before, strict=True):
            pg["lr"] = old
        raise
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    params = [p for p in model.parameters() if p.grad is not None]
    if len(groups) > 1:
        for p in params:
            p.grad.div_(len(groups))
    if max_grad_norm is not None:
        norm = clip_gradients(params, max_grad_norm)
    else:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    optimizer.step()
    norm = float(norm)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    spent = time.perf_counter() - start
    return UpdateStats(loss, norm, suffix, trunk, times, spent)


def clip_gradients(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (the same total norm and coefficient) that scales each gradient's
    local shard by a plain tensor: torch 2.11's own scales replicated DTensor gradients of a TP actor by a wrong
    factor (0.48 off), while sharded ones and the norm are right."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        local.mul_(coef.to(local.device))
    return norm


_Trained = tuple[float, int, int, dict[str, float]]  # mean loss over all groups, suffix/trunk tokens, times


def _train_groups(model: nn.Module):
    """How ``actor_update`` trains a step's groups into ``param.grad`` (summed, not yet averaged): placed
    across the data-parallel ranks when the actor has them, else every group here, in order."""
    state = parallel_state(model)
    return _train_groups_dp if state is not None and state.dims.batch > 1 else _train_groups_here


def _train_groups_here(model: nn.Module, groups: list[RolloutGroup], **kwargs) -> _Trained:
    """Every group on this rank (one process, or a TP/CP/PP actor whose ranks all train every group)."""
    losses, times = [], {}
    suffix = trunk = 0
    for group in groups:
        stats = train_group(model, group, loss="grpo", **kwargs)
        losses.append(stats.loss)
        suffix += stats.suffix_tokens
        trunk += stats.trunk_tokens
        for phase, t in stats.phase_times.items():
            times[phase] = times.get(phase, 0.0) + t
    return sum(losses) / len(losses), suffix, trunk, times


def _train_groups_dp(model: nn.Module, groups: list[RolloutGroup], **kwargs) -> _Trained:
    """The groups placed across the ``dp_replicate x dp_shard`` ranks (``prefixflow.parallel.train_step``:
    every rank passes all groups, trains its share; gradients are summed over the ranks once). The loss and
    token counts cover all ranks' groups; the phase times are this rank's."""
    from ..parallel.dp import train_step

    stats = train_step(model, groups, loss="grpo", **kwargs)
    return stats.loss / len(groups), stats.suffix_tokens, stats.trunk_tokens, stats.phase_times


def named_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters by their name in the unwrapped model (activation-checkpoint wrappers left out), so a
    checkpointed actor and a plain rollout model (or a checkpoint file) agree on names."""
    return {name.replace(_AC_PREFIX, ""): p for name, p in model.named_parameters()}


@torch.no_grad()
def sync_weights(source: nn.Module, target: nn.Module) -> int:
    """Copy ``source``'s parameters into ``target``'s (cast to its dtype); returns the bytes written.
    The colocated weight sync: actor (training copy) -> rollout model (generation copy). A sharded (DTensor)
    actor parameter, under TP or FSDP2, is gathered whole first: every rank of the actor must call this."""
    src, dst = named_parameters(source), named_parameters(target)
    if src.keys() != dst.keys():
        missing = sorted(src.keys() ^ dst.keys())[:3]
        raise ValueError(f"sync_weights: models differ in parameters (e.g. {missing})")
    written = 0
    for name, p in src.items():
        q = dst[name]
        if p.shape != q.shape:
            raise ValueError(f"sync_weights: {name} has shape {tuple(p.shape)} vs {tuple(q.shape)}")
        q.copy_(p.full_tensor() if isinstance(p, DTensor) else p)
        written += q.numel() * q.element_size()
    return written
