"""Token losses shared by every system: ``pg`` (the alignment reference) and ``grpo`` (PPO-clip + KL).

A loss is a weighted sum over the group's response tokens, ``sum_{i,t} w_{i,t} * l_{i,t}``, with weights fixed
by the whole group (never by a microbatch), so any split of the suffixes into microbatches gives the same
objective. ``pg``: ``l = -A_i log pi``, weights ``1/(N |S_i|)``, i.e.
``-(1/N) sum_i A_i mean_t log pi(s_{i,t} | prompt, s_{i,<t})``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .group import RolloutGroup
from .layouts import Microbatch

__all__ = ["LOSSES", "AGGREGATIONS", "LossConfig", "resolve_loss", "microbatch_loss", "token_logprobs"]

LOSSES = ("pg", "grpo")
AGGREGATIONS = ("seq-mean-token-mean", "token-mean")


@dataclass(frozen=True)
class LossConfig:
    """``clip_eps_low/high``: PPO clip range ``[1-low, 1+high]``; ``kl_coef``: weight of the k3 KL estimator
    to ``ref_logprobs`` (0 disables it); ``aggregation``: how token losses are averaged over the group."""

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0
    aggregation: str = "seq-mean-token-mean"


def resolve_loss(loss: str, loss_config: dict | LossConfig | None, group: RolloutGroup) -> LossConfig:
    """Validate ``loss``/``loss_config`` against the group; raises before any computation."""
    if loss not in LOSSES:
        raise ValueError(f"loss {loss!r} unknown; valid losses: {LOSSES}")
    if isinstance(loss_config, LossConfig):
        cfg = loss_config
    else:
        given = dict(loss_config or {})
        valid = {f.name for f in fields(LossConfig)}
        unknown = sorted(set(given) - valid)
        if unknown:
            raise ValueError(f"loss_config has unknown key(s) {unknown}; valid keys: {sorted(valid)}")
        cfg = LossConfig(**given)
    for name in ("clip_eps_low", "clip_eps_high", "kl_coef"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise ValueError(f"loss_config.{name} must be a number >= 0, got {value!r}")
    if cfg.aggregation not in AGGREGATIONS:
        raise ValueError(f"loss_config.aggregation {cfg.aggregation!r} unknown; valid: {AGGREGATIONS}")
    if loss == "pg" and cfg.aggregation != "seq-mean-token-mean":
        raise ValueError(
            "loss='pg' is defined with aggregation 'seq-mean-token-mean'; use loss='grpo' otherwise"
        )
    if cfg.clip_eps_low < 0 or cfg.clip_eps_high < 0 or cfg.kl_coef < 0:
        raise ValueError("loss_config clip_eps_low, clip_eps_high and kl_coef must be >= 0")
    if loss == "grpo" and cfg.kl_coef > 0 and group.ref_logprobs is None:
        raise ValueError("loss_config.kl_coef > 0 needs group.ref_logprobs (per-token reference log-probs)")
    return cfg


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log pi(target) per row of ``logits[T, V]``, computed in fp32 or better."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _weights(group: RolloutGroup, mb: Microbatch, cfg: LossConfig, dtype) -> torch.Tensor:
    lens = torch.tensor(group.response_lens, dtype=dtype, device=mb.response_ids.device)
    if cfg.aggregation == "token-mean":
        return torch.full_like(mb.response_ids, 1.0, dtype=dtype) / lens.sum()
    return 1.0 / (group.n * lens[mb.response_ids])


def _gather(per_response: list[torch.Tensor], mb: Microbatch, dtype) -> torch.Tensor:
    flat = torch.cat(per_response).to(device=mb.response_ids.device, dtype=dtype)
    offsets = torch.tensor([0] + [t.numel() for t in per_response], device=flat.device).cumsum(0)
    return flat[offsets[mb.response_ids] + mb.token_ids]


def microbatch_loss(
    logp: torch.Tensor, mb: Microbatch, group: RolloutGroup, loss: str, cfg: LossConfig
) -> torch.Tensor:
    """This microbatch's share of the group objective (its tokens' weighted losses, summed)."""
    adv = group.advantages.to(device=logp.device, dtype=logp.dtype)[mb.response_ids]
    weights = _weights(group, mb, cfg, logp.dtype)
    if loss == "pg":
        token_loss = -adv * logp
    else:
        old = logp.detach() if group.old_logprobs is None else _gather(group.old_logprobs, mb, logp.dtype)
        ratio = torch.exp(logp - old)
        clipped = torch.clamp(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
        token_loss = -torch.minimum(ratio * adv, clipped * adv)
        if cfg.kl_coef > 0:
            delta = _gather(group.ref_logprobs, mb, logp.dtype) - logp
            token_loss = token_loss + cfg.kl_coef * (torch.exp(delta) - delta - 1.0)
    return (weights * token_loss).sum()
