"""verl's actor loss and micro-batches in PrefixFlow's terms: one :class:`GroupPlan` per uid group of a micro-batch.

What "equals verl" means (verl 0.9.x, ``verl.workers.utils.losses.ppo_loss`` with the ``vanilla`` policy loss).
For a micro-batch, verl back-propagates ``agg(pg) + kl_loss_coef * agg(kl)``, with per-token

- ``pg = max(-A r, -A clip(r, 1-low, 1+high))``, and for ``A < 0`` at most ``-A clip_ratio_c`` (dual clip),
  ``r = exp(clamp(logp - old, -20, 20))``;
- ``kl`` = ``kl_penalty(logp, ref, kl_loss_type)``: ``low_var_kl``/``k3``, ``kl``/``k1``, ``abs``, ``mse``/``k2``;

and ``agg`` (``core_algos.agg_loss``) normalised over the whole mini-batch on every DP rank (``d`` = dp_size,
``T`` = the mini-batch's loss tokens over all ranks, ``G`` = ``global_batch_size``, ``L`` = ``loss_scale_factor`` or
the response width): ``token-mean`` weights every token ``d/T``, ``token-sum`` ``d``, ``seq-mean-token-sum``
``d/G``, ``seq-mean-token-sum-norm`` ``d/(G L)``, ``seq-mean-token-mean`` ``d/(G (|S_i| + 1e-8))``. Those
weights depend on no micro-batch and no group, so a uid group split across micro-batches trains as one
:func:`prefixflow.train_group` per part and the sum is unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass

import torch

from ...group import RolloutGroup
from ...loss import LossConfig

__all__ = [
    "GroupPlan",
    "KL_TYPES",
    "AGG_MODES",
    "actor_loss_config",
    "plan_micro_batch",
    "score_plans",
    "loss_callable_config",
    "check_batch",
    "phase_b_budget",
]

AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
)
KL_TYPES = {"low_var_kl": "low_var_kl", "k3": "low_var_kl", "kl": "kl", "k1": "kl", "abs": "abs"}
KL_TYPES |= {"mse": "mse", "k2": "mse"}
LOG_RATIO_CLAMP = 20.0  # verl clamps logp - old to [-20, 20] before exp
SEQ_LEN_EPS = 1e-8  # verl's seq-mean-token-mean adds it to each response's token count


@dataclass
class GroupPlan:
    """Rows of one micro-batch trained as one group: one uid's rows (``system="prefixflow"``), or one row on
    full sequences (``"baseline"``) where a uid's prompts differ."""

    rows: list[int]
    group: RolloutGroup
    loss_config: LossConfig
    system: str = "prefixflow"
    microbatch: int | None = None  # responses per Phase-B microbatch (None: all)

    def on_rows(self, rows: torch.Tensor) -> GroupPlan:
        """The same plan with its rows renumbered through ``rows`` (a micro-batch's rows in the whole batch)."""
        return dataclasses.replace(self, rows=[int(rows[r]) for r in self.rows])


def loss_callable_config(loss_function):
    """The ``ActorConfig`` bound to verl's ``ppo_loss`` (``functools.partial(ppo_loss, config=...)``, as verl's
    worker builds it); any other loss callable is refused by name."""
    from verl.workers.utils.losses import ppo_loss

    if isinstance(loss_function, functools.partial) and loss_function.func is ppo_loss:
        if "config" in loss_function.keywords and not loss_function.args:
            return loss_function.keywords["config"]
    name = getattr(getattr(loss_function, "func", loss_function), "__qualname__", repr(loss_function))
    raise ValueError(
        f"PrefixFlow's verl engine trains verl's ppo_loss (functools.partial(ppo_loss, config=actor_config)); "
        f"got loss function {name!r}"
    )


def actor_loss_config(config) -> dict:
    """The loss options of a verl ``ActorConfig`` as :class:`LossConfig` fields (without the batch-dependent
    normalisers); raises ``ValueError`` naming each option PrefixFlow does not reproduce."""
    policy = config.policy_loss
    loss_mode = policy.get("loss_mode", "vanilla") if policy is not None else "vanilla"
    kl_type = str(config.kl_loss_type)
    bad = []
    if loss_mode != "vanilla":
        bad.append(f"policy_loss.loss_mode={loss_mode!r} (supported: 'vanilla')")
    if config.loss_agg_mode not in AGG_MODES:
        bad.append(f"loss_agg_mode={config.loss_agg_mode!r} (supported: {AGG_MODES})")
    if float(config.entropy_coeff) != 0.0:
        bad.append(f"entropy_coeff={config.entropy_coeff} (entropy bonus; set it to 0)")
    if config.get("calculate_entropy", False):
        bad.append("calculate_entropy=True (entropy metric)")
    if config.use_kl_loss and kl_type not in KL_TYPES:
        bad.append(f"kl_loss_type={kl_type!r} (supported: {sorted(KL_TYPES)})")
    factor = config.loss_scale_factor
    if factor is not None and (not float(factor).is_integer() or factor < 1):
        bad.append(f"loss_scale_factor={factor!r} (an integer >= 1 or None)")
    if bad:
        raise ValueError(f"PrefixFlow's verl engine does not support: {'; '.join(bad)}")
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    use_kl = bool(config.use_kl_loss)
    return {
        "clip_eps_low": float(low),
        "clip_eps_high": float(high),
        "clip_ratio_c": float(config.get("clip_ratio_c", 3.0)),
        "log_ratio_clamp": LOG_RATIO_CLAMP,
        "kl_coef": float(config.kl_loss_coef) if use_kl else 0.0,
        "kl_estimator": KL_TYPES[kl_type] if use_kl else "k3",
        "aggregation": config.loss_agg_mode,
    }


def _temperature(micro_batch) -> float:
    t = micro_batch["temperature"]
    if isinstance(t, torch.Tensor):
        if t.numel() == 0 or not bool((t == t.flatten()[0]).all()):
            raise ValueError("per-sample temperature is not supported by PrefixFlow's verl engine")
        t = t.flatten()[0].item()
    return float(t)


def _row_positions_ok(position_ids, row: int, length: int) -> bool:
    pos = position_ids[row]
    return pos.dim() == 1 and pos.numel() == length and bool((pos == torch.arange(length)).all())


def plan_micro_batch(
    micro_batch,
    base: dict,
    *,
    dp_size: int,
    sp_size: int = 1,
    batch_tokens,
    global_batch_size,
    loss_scale_factor=None,
    token_budget: dict | None = None,
) -> list[GroupPlan]:
    """One plan per uid of a verl micro-batch (a TensorDict: left-padded ``prompts``, right-padded ``responses``,
    ``attention_mask``, ``response_mask``, token-level ``advantages``, ``old_log_probs``, ``ref_log_prob``,
    ``uid``). Rows without loss tokens add nothing and get no plan. ``token_budget``: :func:`phase_b_budget`'s
    bound on each Phase-B microbatch (None: one microbatch per group). Raises ``ValueError`` naming what it
    cannot reproduce; warns and falls back to full sequences for a uid whose prompts differ."""
    prompts, responses = micro_batch["prompts"], micro_batch["responses"]
    attention, response_mask = micro_batch["attention_mask"], micro_batch["response_mask"].bool()
    if any(t.is_nested for t in (prompts, responses, attention, response_mask)):
        raise ValueError(
            "PrefixFlow's verl engine needs padded prompts/responses/attention_mask/response_mask"
        )
    p = prompts.shape[1]
    position_ids = micro_batch["position_ids"]
    if position_ids.dim() == 3 or (not position_ids.is_nested and position_ids.dim() != 2):
        raise ValueError(
            "position_ids must be one position per token (multi-dimensional RoPE is not supported)"
        )
    position_ids = position_ids.unbind() if position_ids.is_nested else None
    advantages, old = micro_batch["advantages"], micro_batch["old_log_probs"]
    ref = micro_batch["ref_log_prob"] if base["kl_coef"] > 0 else None
    uids = list(micro_batch["uid"]) if "uid" in micro_batch.keys() else None
    b = prompts.shape[0]
    if uids is None:
        warnings.warn(
            "verl micro-batch has no 'uid': PrefixFlow trains its rows on full sequences", stacklevel=3
        )
        uids = [("__row__", r) for r in range(b)]

    lens = response_mask.sum(-1).tolist()
    norm = dict(base)
    norm["temperature"] = _temperature(micro_batch)
    # verl scales its loss by dp_size; under Ulysses each SP rank's gradient is its token shard's and FSDP
    # averages over dp_size * sp_size ranks (verl's all-gather backward multiplies by sp_size the same way)
    norm["group_weight"] = float(dp_size * sp_size)
    if base["aggregation"] == "token-mean":
        norm["batch_tokens"] = float(batch_tokens)
    elif base["aggregation"] != "token-sum":
        # verl: the global batch size, or (one rank, none given) this micro-batch's rows that carry loss
        size = global_batch_size if global_batch_size is not None else sum(1 for n in lens if n > 0)
        norm["batch_size"] = float(size)
    if base["aggregation"] == "seq-mean-token-sum-norm":
        horizon = int(response_mask.shape[-1])  # verl's default: the padded response width
        norm["norm_len"] = horizon  # a bound on every response, as LossConfig requires
        if loss_scale_factor is not None:  # verl's constant may be any scale: the loss is linear in 1/norm
            norm["group_weight"] *= horizon / float(loss_scale_factor)
    if base["aggregation"] == "seq-mean-token-mean":
        norm["seq_len_eps"] = SEQ_LEN_EPS
    config = LossConfig(**norm)

    rows_by_uid: dict = {}
    for r in range(b):
        n = int(lens[r])
        valid = attention[r, p:].bool()
        if not bool((response_mask[r] == valid).all()) or not bool(valid[:n].all()):
            raise ValueError(
                f"micro-batch row {r}: response_mask must equal the right-padded response attention mask "
                "(token masks inside a response, e.g. multi-turn tool output, are not supported)"
            )
        if n == 0:
            continue
        plen = int(attention[r, :p].sum())
        if not bool(attention[r, p - plen : p].all()):
            raise ValueError(f"micro-batch row {r}: prompts must be left-padded")
        if plen < 1:
            raise ValueError(f"micro-batch row {r}: empty prompt")
        if position_ids is not None and not _row_positions_ok(position_ids, r, plen + n):
            raise ValueError(f"micro-batch row {r}: position_ids must be 0..len-1 over prompt and response")
        adv = advantages[r, :n]
        if not bool((adv == adv[0]).all()):
            raise ValueError(
                f"micro-batch row {r}: token-level advantages vary within the response (GRPO broadcasts one "
                "scalar per response; PrefixFlow trains one advantage per response)"
            )
        rows_by_uid.setdefault(uids[r], []).append(r)

    def row_group(rows: list[int]) -> RolloutGroup:
        first = rows[0]
        plen = int(attention[first, :p].sum())
        return RolloutGroup(
            prompt=prompts[first, p - plen :],
            responses=[responses[r, : lens[r]] for r in rows],
            advantages=torch.stack([advantages[r, 0] for r in rows]),
            old_logprobs=[old[r, : lens[r]] for r in rows],
            ref_logprobs=None if ref is None else [ref[r, : lens[r]] for r in rows],
        )

    plans = []
    for uid, rows in rows_by_uid.items():
        prompt = _prompt(prompts, attention, p, rows[0])
        same = all(torch.equal(_prompt(prompts, attention, p, r), prompt) for r in rows[1:])
        if same:
            plen = int(attention[rows[0], :p].sum())
            size = _phase_b_size(plen, [int(lens[r]) for r in rows], token_budget)
            plans.append(GroupPlan(rows, row_group(rows), config, microbatch=size))
            continue
        warnings.warn(
            f"verl uid {uid!r}: its rows' prompts differ; PrefixFlow trains them on full sequences",
            stacklevel=3,
        )
        plans += [GroupPlan([r], row_group([r]), config, system="baseline") for r in rows]
    return plans


def score_plans(micro_batch) -> list[GroupPlan]:
    """Forward-only groups of a verl micro-batch (log-probs, no loss): the rows of one uid whose prompts agree
    score as one group, every other row alone; rows without response tokens score nothing."""
    prompts, responses, attention = (
        micro_batch["prompts"],
        micro_batch["responses"],
        micro_batch["attention_mask"],
    )
    if any(t.is_nested for t in (prompts, responses, attention)):
        raise ValueError("PrefixFlow's verl engine needs padded prompts/responses/attention_mask")
    p, b = prompts.shape[1], prompts.shape[0]
    lens = attention[:, p:].sum(-1).tolist()
    uids = list(micro_batch["uid"]) if "uid" in micro_batch.keys() else [("__row__", r) for r in range(b)]
    config = LossConfig(temperature=_temperature(micro_batch))
    by_key: dict = {}
    for r in range(b):
        if int(lens[r]) == 0:
            continue
        if not bool(attention[r, p : p + int(lens[r])].all()):
            raise ValueError(f"micro-batch row {r}: responses must be right-padded")
        by_key.setdefault((uids[r], tuple(_prompt(prompts, attention, p, r).tolist())), []).append(r)
    plans = []
    for rows in by_key.values():
        group = RolloutGroup(
            prompt=_prompt(prompts, attention, p, rows[0]),
            responses=[responses[r, : int(lens[r])] for r in rows],
            advantages=torch.zeros(len(rows)),
        )
        plans.append(GroupPlan(rows, group, config))
    return plans


def _prompt(prompts, attention, p: int, row: int) -> torch.Tensor:
    plen = int(attention[row, :p].sum())
    return prompts[row, p - plen :]


def _phase_b_size(plen: int, lens: list[int], budget: dict | None) -> int | None:
    """Responses per Phase-B microbatch (consecutive, as ``train_group`` splits them): at most
    ``budget["rows"]``, or the most whose prompt (its Phase-A graph lives through Phase C) plus their response
    tokens stay within ``budget["tokens"]`` (verl's count: real tokens); None when all fit at once."""
    if budget is None:
        return None
    if "rows" in budget:
        k = int(budget["rows"])
    else:
        k = 1
        for size in range(2, len(lens) + 1):
            widest = max(sum(lens[i : i + size]) for i in range(len(lens) - size + 1))
            if plen + widest > budget["tokens"]:
                break
            k = size
    return None if k >= len(lens) else max(k, 1)


def phase_b_budget(data, sp_size: int = 1) -> dict:
    """verl's bound on a micro-batch, for PrefixFlow's Phase-B microbatches: ``{"tokens": max_token_len_per_gpu
    * sp_size}`` under ``use_dynamic_bsz`` (verl's ``prepare_micro_batches``), else ``{"rows":
    micro_batch_size_per_gpu}``."""
    from verl.utils import tensordict_utils as tu

    if tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
        tokens = tu.get_non_tensor_data(data=data, key="max_token_len_per_gpu", default=None)
        if tokens is None or int(tokens) < 1:
            raise ValueError(
                "use_dynamic_bsz=True needs actor.ppo_max_token_len_per_gpu (the batch's max_token_len_per_gpu)"
            )
        return {"tokens": int(tokens) * int(sp_size)}
    rows = tu.get_non_tensor_data(data=data, key="micro_batch_size_per_gpu", default=None)
    if rows is None or int(rows) < 1:
        raise ValueError("use_dynamic_bsz=False needs actor.ppo_micro_batch_size_per_gpu >= 1")
    return {"rows": int(rows)}


_PADDED_KEYS = ("prompts", "responses", "attention_mask", "response_mask", "advantages", "old_log_probs")
_FINITE_KEYS = ("advantages", "old_log_probs", "ref_log_prob")


def check_batch(data, *, kl: bool) -> None:
    """A verl actor batch as ``left_right_2_no_padding`` leaves it, checked before any gradient changes: raises
    ``ValueError`` in one line naming the key that is missing, mis-shaped or non-finite (NaN/inf)."""
    keys = set(data.keys())
    need = [*_PADDED_KEYS, "input_ids", "loss_mask", "temperature"] + (["ref_log_prob"] if kl else [])
    missing = [k for k in need if k not in keys]
    if missing:
        raise ValueError(f"verl batch is missing key(s) {missing} (the actor update needs {need})")
    for key in _PADDED_KEYS + (("ref_log_prob",) if kl else ()):
        t = data[key]
        if not isinstance(t, torch.Tensor) or t.is_nested or t.dim() != 2:
            raise ValueError(f"verl batch key {key!r} must be a padded [batch, length] tensor")
    b, p = data["prompts"].shape
    r = data["responses"].shape[1]
    want = {"prompts": (b, p), "responses": (b, r), "attention_mask": (b, p + r), "response_mask": (b, r)}
    want |= {k: (b, r) for k in ("advantages", "old_log_probs", "ref_log_prob")}
    for key in _PADDED_KEYS + (("ref_log_prob",) if kl else ()):
        if tuple(data[key].shape) != want[key]:
            raise ValueError(
                f"verl batch key {key!r} has shape {tuple(data[key].shape)}, expected {want[key]} "
                f"([batch, prompt + response] from prompts {tuple(data['prompts'].shape)} and responses "
                f"{tuple(data['responses'].shape)})"
            )
    ids = data["input_ids"]
    lengths = ids.offsets().diff() if ids.is_nested else None
    if (
        lengths is None
        or len(lengths) != b
        or not torch.equal(lengths.cpu(), data["attention_mask"].sum(-1).cpu())
    ):
        raise ValueError(
            "verl batch key 'input_ids' must be the nested (no-padding) rows of attention_mask, one per row "
            "(verl's left_right_2_no_padding)"
        )
    if "uid" in keys and len(data["uid"]) != b:
        raise ValueError(f"verl batch key 'uid' has {len(data['uid'])} entries for {b} rows")
    mask = data["response_mask"].bool()
    for key in _FINITE_KEYS:
        if key in keys and (key != "ref_log_prob" or kl):
            bad = ~torch.isfinite(data[key]) & mask
            if bool(bad.any()):
                rows = sorted({int(i) for i in bad.nonzero()[:, 0].tolist()})
                raise ValueError(
                    f"verl batch key {key!r} has {int(bad.sum())} non-finite value(s) (NaN/inf) on response "
                    f"tokens, rows {rows[:8]}{'...' if len(rows) > 8 else ''}"
                )
