"""Token losses shared by every system: ``pg`` (the alignment reference) and ``grpo`` (PPO-clip + KL).

A loss is a weighted sum over the group's response tokens, ``sum_{i,t} w_{i,t} * l_{i,t}``, with weights fixed
by the whole group (never by a microbatch), so any split of the suffixes into microbatches gives the same
objective. ``pg``: ``l = -A_i log pi``, weights ``1/(N |S_i|)``, i.e.
``-(1/N) sum_i A_i mean_t log pi(s_{i,t} | prompt, s_{i,<t})``.

``grpo`` covers TRL's GRPO family (``prefixflow.integrations.trl`` maps a ``GRPOConfig`` onto it):
``l = -min(r A, clip(r, 1-eps_low, 1+eps_high) A) + beta * KL``, with ``r`` the token ratio or, with
``importance_sampling="sequence"``, the ratio of the response's mean log-ratio (GSPO); ``ratio_cap`` caps the
unclipped ``r`` (TRL's ``delta``); ``kl_ratio_correction`` multiplies the k3 KL by ``r`` (TRL's
``use_bias_correction_kl``); ``temperature`` divides the logits before the log-softmax. Aggregations (weights):
``seq-mean-token-mean`` ``1/(N |S_i|)`` (TRL ``grpo``), ``token-mean`` ``1/sum_i |S_i|`` (TRL ``bnpo``/``dapo``
over their token counts), ``seq-mean-token-sum`` ``1/N``, ``seq-mean-token-sum-norm`` ``1/(N norm_len)`` (TRL
``dr_grpo``, ``norm_len`` = ``max_completion_length``), ``token-sum`` ``1``. ``group_weight`` scales the whole group
objective: the group's share of a larger batch objective (e.g. a TRL micro-batch holding several prompts).

verl's actor loss (``prefixflow.integrations.verl`` maps an ``ActorConfig`` onto it) adds, each off by default
so the numbers above are unchanged: ``clip_ratio_c`` (dual clip: for ``A < 0`` the token loss is at most
``-A c``), ``log_ratio_clamp`` (verl clamps ``log r`` to ``[-20, 20]`` before ``exp``), ``kl_estimator``
(``k3`` as TRL; ``low_var_kl`` = k3 of the clamped log-ratio, clamped to ``[-10, 10]``; ``kl`` = k1
``logp - ref``; ``abs`` = ``|logp - ref|``; ``mse`` = k2 ``(logp - ref)^2 / 2``), and batch-global normalisers:
``batch_tokens`` replaces the group's token count in ``token-mean``, ``batch_size`` its response count ``N`` in
the ``seq-mean-*`` modes (verl 0.9.x normalises over the whole mini-batch), and ``seq_len_eps`` is added to
``|S_i|`` in ``seq-mean-token-mean`` (verl's ``1e-8``).

``policy`` picks the policy term (TRL 1.16's other loss types; default ``"clip"`` is the PPO-clip above):
``"cispo"``: ``-sg(min(r, cispo_cap)) A log pi`` (MiniMax-M1; TRL's ``epsilon_high`` is the cap);
``"sapo"``: ``-sigmoid(tau (r-1)) 4/tau A``, ``tau`` = ``sapo_tau_pos`` if ``A > 0`` else ``sapo_tau_neg``
(``tau``, ``k`` and ``lam`` rounded to fp32 first, as TRL's ``torch.where`` over Python floats does);
``"vespo"``: ``-sg(phi(w)) A log pi`` with ``w`` the response's ratio ``exp(sum_t clamp(log r_t, +-20))``
clamped to ``[1e-8, e^20]`` and ``phi(w) = exp(lam + k log w - lam w)`` (``k, lam`` = ``vespo_k/lambda_pos`` if
``A >= 0`` else ``_neg``; non-finite phi -> 0). ``off_policy_threshold`` (TRL's off-policy sequence mask) zeroes
the policy term (not the KL) of a response with ``A < 0`` whose mean ``old - sg(log pi)`` exceeds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from .group import RolloutGroup
from .tree.layouts import Microbatch

__all__ = [
    "LOSSES",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICIES",
    "LossConfig",
    "resolve_loss",
    "microbatch_loss",
    "token_logprobs",
]

LOSSES = ("pg", "grpo")
AGGREGATIONS = (
    "seq-mean-token-mean",
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "token-sum",
)
IMPORTANCE_SAMPLING = ("token", "sequence")
POLICIES = ("clip", "cispo", "sapo", "vespo")
KL_ESTIMATORS = ("k3", "low_var_kl", "kl", "abs", "mse")


@dataclass(frozen=True)
class LossConfig:
    """``clip_eps_low/high``: PPO clip range ``[1-low, 1+high]``; ``kl_coef``: weight of the k3 KL estimator
    to ``ref_logprobs`` (0 disables it); ``aggregation``: how token losses are averaged over the group (see the
    module docstring, with ``norm_len`` for ``seq-mean-token-sum-norm``); ``importance_sampling``: ``"token"`` or
    ``"sequence"`` ratios; ``ratio_cap``: upper cap on the unclipped ratio (None = none); ``kl_ratio_correction``:
    KL times the ratio; ``temperature``: logits are divided by it; ``group_weight``: scale of the group objective.
    ``clip_ratio_c``, ``log_ratio_clamp``, ``kl_estimator``, ``batch_tokens``, ``batch_size``, ``seq_len_eps``:
    verl's loss (module docstring); their defaults leave the loss above unchanged.
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0
    aggregation: str = "seq-mean-token-mean"
    importance_sampling: str = "token"
    ratio_cap: float | None = None
    kl_ratio_correction: bool = False
    temperature: float = 1.0
    norm_len: int | None = None
    group_weight: float = 1.0
    clip_ratio_c: float | None = None
    log_ratio_clamp: float | None = None
    kl_estimator: str = "k3"
    batch_tokens: float | None = None
    batch_size: float | None = None
    seq_len_eps: float = 0.0
    policy: str = "clip"
    cispo_cap: float | None = None
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_threshold: float | None = None


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
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"loss_config.{name} must be a finite number >= 0, got {value!r}")
    if cfg.aggregation not in AGGREGATIONS:
        raise ValueError(f"loss_config.aggregation {cfg.aggregation!r} unknown; valid: {AGGREGATIONS}")
    _check_trl_fields(cfg, loss, group)
    _check_verl_fields(cfg, loss)
    _check_policy_fields(cfg, loss)
    if loss == "pg" and cfg.aggregation != "seq-mean-token-mean":
        raise ValueError(
            "loss='pg' is defined with aggregation 'seq-mean-token-mean'; use loss='grpo' otherwise"
        )
    if cfg.clip_eps_low < 0 or cfg.clip_eps_high < 0 or cfg.kl_coef < 0:
        raise ValueError("loss_config clip_eps_low, clip_eps_high and kl_coef must be >= 0")
    if loss == "grpo" and cfg.kl_coef > 0 and group.ref_logprobs is None:
        raise ValueError("loss_config.kl_coef > 0 needs group.ref_logprobs (per-token reference log-probs)")
    return cfg


def _number(value) -> bool:
    """A finite int or float (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _trained_counts(group) -> list[int]:
    """Each response's trained tokens (a tree's ``PathLosses`` already counts them): tool output under a
    loss mask is context, so a rollout may run past TRL's max_completion_length in tokens but not in loss."""
    masks = getattr(group, "loss_masks", None)
    if masks is not None:
        return [int(m.sum()) for m in masks]
    return list(getattr(group, "response_lens", None) or [])


def _check_trl_fields(cfg: LossConfig, loss: str, group: RolloutGroup) -> None:
    if cfg.importance_sampling not in IMPORTANCE_SAMPLING:
        raise ValueError(
            f"loss_config.importance_sampling {cfg.importance_sampling!r} unknown; valid: {IMPORTANCE_SAMPLING}"
        )
    if not isinstance(cfg.kl_ratio_correction, bool):
        raise ValueError(f"loss_config.kl_ratio_correction must be a bool, got {cfg.kl_ratio_correction!r}")
    if not _number(cfg.temperature) or cfg.temperature <= 0:
        raise ValueError(f"loss_config.temperature must be a finite number > 0, got {cfg.temperature!r}")
    if not _number(cfg.group_weight) or cfg.group_weight < 0:
        raise ValueError(f"loss_config.group_weight must be a finite number >= 0, got {cfg.group_weight!r}")
    if cfg.ratio_cap is not None and (not _number(cfg.ratio_cap) or cfg.ratio_cap <= 0):
        raise ValueError(f"loss_config.ratio_cap must be None or a finite number > 0, got {cfg.ratio_cap!r}")
    if cfg.aggregation == "seq-mean-token-sum-norm":
        if isinstance(cfg.norm_len, bool) or not isinstance(cfg.norm_len, int) or cfg.norm_len < 1:
            raise ValueError(
                "loss_config.aggregation 'seq-mean-token-sum-norm' needs norm_len, an int >= 1 "
                f"(e.g. TRL's max_completion_length), got {cfg.norm_len!r}"
            )
        longest = max(_trained_counts(group) or [0])
        if cfg.norm_len < longest:
            raise ValueError(
                f"loss_config.norm_len={cfg.norm_len} is shorter than the longest response ({longest} trained "
                "tokens); "
                "it is the completion length bound (TRL's max_completion_length): use at least that"
            )
    elif cfg.norm_len is not None:
        raise ValueError("loss_config.norm_len is only used by aggregation 'seq-mean-token-sum-norm'")
    if loss == "pg" and (
        cfg.importance_sampling != "token" or cfg.ratio_cap is not None or cfg.kl_ratio_correction
    ):
        raise ValueError("importance_sampling, ratio_cap and kl_ratio_correction apply to loss='grpo' only")
    grpo_only = {k: v for k, v in _GRPO_DEFAULTS.items() if getattr(cfg, k) != v}
    if loss == "pg" and grpo_only:
        raise ValueError(
            f"loss_config {sorted(grpo_only)} apply to loss='grpo' only (loss='pg' has no clipping or KL); "
            "drop them or use loss='grpo'"
        )


# loss='grpo''s PPO-clip and KL fields: loss='pg' ignores them, so a value other than the default is refused
_GRPO_DEFAULTS = {"clip_eps_low": 0.2, "clip_eps_high": 0.2, "kl_coef": 0.0}


def _check_verl_fields(cfg: LossConfig, loss: str) -> None:
    if cfg.kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"loss_config.kl_estimator {cfg.kl_estimator!r} unknown; valid: {KL_ESTIMATORS}")
    if cfg.clip_ratio_c is not None and (not _number(cfg.clip_ratio_c) or cfg.clip_ratio_c <= 1.0):
        raise ValueError(
            f"loss_config.clip_ratio_c must be None or a finite number > 1, got {cfg.clip_ratio_c!r}"
        )
    for name in ("log_ratio_clamp", "batch_tokens", "batch_size"):
        value = getattr(cfg, name)
        if value is not None and (not _number(value) or value <= 0):
            raise ValueError(f"loss_config.{name} must be None or a finite number > 0, got {value!r}")
    if not _number(cfg.seq_len_eps) or cfg.seq_len_eps < 0:
        raise ValueError(f"loss_config.seq_len_eps must be a finite number >= 0, got {cfg.seq_len_eps!r}")
    verl_set = [
        name
        for name in ("clip_ratio_c", "log_ratio_clamp", "batch_tokens", "batch_size")
        if getattr(cfg, name) is not None
    ]
    if cfg.kl_estimator != "k3":
        verl_set.append("kl_estimator")
    if cfg.seq_len_eps:
        verl_set.append("seq_len_eps")
    if loss == "pg" and verl_set:
        raise ValueError(f"loss_config fields {verl_set} apply to loss='grpo' only")
    if cfg.kl_ratio_correction and cfg.kl_estimator != "k3":
        raise ValueError("loss_config.kl_ratio_correction is defined for kl_estimator 'k3' only")


# the policy terms' parameters and their defaults (a changed value needs its policy)
_POLICY_PARAMS = {
    "cispo": {"cispo_cap": None},
    "sapo": {"sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05},
    "vespo": {"vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0},
}


def _check_policy_fields(cfg: LossConfig, loss: str) -> None:
    if cfg.policy not in POLICIES:
        raise ValueError(f"loss_config.policy {cfg.policy!r} unknown; valid: {POLICIES}")
    if loss == "pg" and (cfg.policy != "clip" or cfg.off_policy_threshold is not None):
        raise ValueError("loss_config.policy and off_policy_threshold apply to loss='grpo' only")
    for policy, params in _POLICY_PARAMS.items():
        for name, default in params.items():
            value = getattr(cfg, name)
            if value != default and cfg.policy != policy:
                raise ValueError(
                    f"loss_config.{name} applies to policy={policy!r} only (policy={cfg.policy!r})"
                )
            if value is not None and not _number(value):
                raise ValueError(f"loss_config.{name} must be a finite number, got {value!r}")
    if cfg.policy == "cispo" and (cfg.cispo_cap is None or cfg.cispo_cap <= 0):
        raise ValueError(f"loss_config.policy='cispo' needs cispo_cap, a number > 0, got {cfg.cispo_cap!r}")
    if cfg.policy == "sapo" and min(cfg.sapo_tau_pos, cfg.sapo_tau_neg) <= 0:
        raise ValueError("loss_config.sapo_tau_pos and sapo_tau_neg must be > 0")
    if cfg.policy == "vespo" and cfg.importance_sampling != "token":
        raise ValueError(
            "loss_config.policy='vespo' forms its own sequence weight: use importance_sampling='token'"
        )
    if cfg.policy != "clip" and (cfg.ratio_cap is not None or cfg.clip_ratio_c is not None):
        raise ValueError(
            f"loss_config.ratio_cap and clip_ratio_c apply to policy='clip' only, not {cfg.policy!r}"
        )
    t = cfg.off_policy_threshold
    if t is not None and not _number(t):
        raise ValueError(f"loss_config.off_policy_threshold must be None or a finite number, got {t!r}")


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log pi(target) per row of ``logits[T, V] / temperature``, computed in fp32 or better."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _weights(group: RolloutGroup, mb: Microbatch, cfg: LossConfig, dtype) -> torch.Tensor:
    lens = torch.tensor(group.response_lens, dtype=dtype, device=mb.response_ids.device)
    ones = torch.ones_like(mb.response_ids, dtype=dtype)
    n = group.n if cfg.batch_size is None else cfg.batch_size
    if cfg.aggregation == "token-mean":
        weights = ones / (lens.sum() if cfg.batch_tokens is None else cfg.batch_tokens)
    elif cfg.aggregation == "token-sum":
        weights = ones
    elif cfg.aggregation == "seq-mean-token-sum":
        weights = ones / n
    elif cfg.aggregation == "seq-mean-token-sum-norm":
        weights = ones / (n * cfg.norm_len)
    elif cfg.seq_len_eps:
        weights = 1.0 / (n * (lens[mb.response_ids] + cfg.seq_len_eps))
    else:
        weights = 1.0 / (n * lens[mb.response_ids])
    return weights * cfg.group_weight if cfg.group_weight != 1.0 else weights


def _whole_responses(mb: Microbatch, option: str, fix: str = "") -> None:
    if mb.sequence is not None:
        raise ValueError(
            f"loss_config.{option} needs each response's tokens on one rank; "
            f"context parallelism spreads them over the CP group{fix}"
        )


def _response_sums(x: torch.Tensor, mb: Microbatch, group: RolloutGroup) -> torch.Tensor:
    return torch.zeros(group.n, dtype=x.dtype, device=x.device).index_add(0, mb.response_ids, x)


def _response_mean(x: torch.Tensor, mb: Microbatch, group: RolloutGroup) -> torch.Tensor:
    """Each token's value replaced by the mean over its response (every response lies in one microbatch)."""
    lens = torch.tensor(group.response_lens, dtype=x.dtype, device=x.device)
    return (_response_sums(x, mb, group) / lens)[mb.response_ids]


def _response_sum(x: torch.Tensor, mb: Microbatch, group: RolloutGroup) -> torch.Tensor:
    """Each token's value replaced by the sum over its response (every response lies in one microbatch)."""
    return _response_sums(x, mb, group)[mb.response_ids]


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
        log_ratio = logp - old
        if cfg.log_ratio_clamp is not None:
            log_ratio = torch.clamp(log_ratio, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
        token_log_ratio = log_ratio
        if cfg.importance_sampling == "sequence":
            _whole_responses(mb, "importance_sampling='sequence'", " (use 'token')")
            log_ratio = _response_mean(log_ratio, mb, group)
        ratio = torch.exp(log_ratio)
        token_loss = _policy_term(cfg, ratio, adv, logp, token_log_ratio, mb, group)
        if cfg.off_policy_threshold is not None:
            _whole_responses(mb, "off_policy_threshold")
            drift = _response_mean(torch.nan_to_num(old - logp.detach(), nan=0.0), mb, group)
            token_loss = token_loss * ((adv >= 0) | (drift <= cfg.off_policy_threshold)).to(logp.dtype)
        if cfg.kl_coef > 0:
            kl = _kl(_gather(group.ref_logprobs, mb, logp.dtype), logp, cfg.kl_estimator)
            token_loss = token_loss + cfg.kl_coef * (kl * ratio if cfg.kl_ratio_correction else kl)
    return (weights * token_loss).sum()


def _policy_term(cfg, ratio, adv, logp, token_log_ratio, mb, group) -> torch.Tensor:
    """The per-token policy loss of ``cfg.policy`` (module docstring)."""
    if cfg.policy == "cispo":
        return -torch.clamp(ratio, max=cfg.cispo_cap).detach() * adv * logp
    if cfg.policy == "sapo":
        # torch.where over Python floats gives fp32 (as in TRL; 1.05 is not an fp32 number), then our dtype
        tau = torch.where(adv > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg).to(ratio.dtype)
        return -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv
    if cfg.policy == "vespo":
        _whole_responses(mb, "policy='vespo'")
        with torch.no_grad():
            seq = _response_sum(torch.clamp(token_log_ratio.detach(), -20.0, 20.0), mb, group)
            log_w = torch.clamp(seq, math.log(1e-8), 20.0)
            nonneg = adv >= 0
            k = torch.where(nonneg, cfg.vespo_k_pos, cfg.vespo_k_neg).to(logp.dtype)
            lam = (
                torch.where(nonneg, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg).to(logp.dtype).clamp(min=1e-4)
            )
            phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(
                nan=0.0, posinf=0.0, neginf=0.0
            )
        return -phi * adv * logp
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    unclipped = ratio if cfg.ratio_cap is None else torch.clamp(ratio, max=cfg.ratio_cap)
    token_loss = -torch.minimum(unclipped * adv, clipped * adv)
    if cfg.clip_ratio_c is not None:  # dual clip: a negative advantage's loss is at most -A c
        token_loss = torch.where(adv < 0, torch.minimum(token_loss, -adv * cfg.clip_ratio_c), token_loss)
    return token_loss


def _kl(ref: torch.Tensor, logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """The per-token KL estimate to the reference policy (:data:`KL_ESTIMATORS`)."""
    if estimator == "k3":
        delta = ref - logp
        return torch.exp(delta) - delta - 1.0
    if estimator == "low_var_kl":
        delta = torch.clamp(ref - logp, -20.0, 20.0)
        return torch.clamp(torch.exp(delta) - delta - 1.0, -10.0, 10.0)
    if estimator == "kl":
        return logp - ref
    if estimator == "abs":
        return (logp - ref).abs()
    return 0.5 * (logp - ref).square()
