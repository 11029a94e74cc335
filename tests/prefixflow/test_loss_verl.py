"""verl's loss options of ``prefixflow.loss`` (no verl needed): the formula, split- and schedule-invariance, refusals.

Agreement with verl's own ``ppo_loss`` through its FSDP engine is tested in tests/verl_integration/ (.venv-verl).
Here ``microbatch_loss`` is checked in fp64 against verl's definitions written out (``core_algos`` of verl 0.9.1:
``compute_policy_loss_vanilla``, ``kl_penalty``, ``agg_loss`` with mini-batch-global normalisers).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import tiny_model
from support.reference import max_rel_diff

import prefixflow as pf
from prefixflow.loss import LossConfig, microbatch_loss, resolve_loss
from prefixflow.tree.layouts import Microbatch

MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")
KL = ("low_var_kl", "kl", "abs", "mse")


def _verl_reference(logp, old, ref, adv, mask, mode, kl_type, kl_coef, c, tokens, size, horizon):
    """verl 0.9.1's micro-batch loss on padded [B, R] tensors (one rank), written out from its definition."""
    neg_kl = torch.clamp(logp - old, -20.0, 20.0)
    ratio = torch.exp(neg_kl)
    pg1, pg2 = -adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.28)
    clip1 = torch.maximum(pg1, pg2)
    pg = torch.where(adv < 0, torch.minimum(-adv * c, clip1), clip1)
    if kl_type == "low_var_kl":
        d = torch.clamp(ref - logp, -20, 20)
        kl = torch.clamp(torch.exp(d) - d - 1, -10, 10)
    elif kl_type == "kl":
        kl = logp - ref
    elif kl_type == "abs":
        kl = (logp - ref).abs()
    else:
        kl = 0.5 * (logp - ref).square()

    def agg(x):
        if mode == "token-mean":
            return (x * mask).sum() / tokens
        if mode == "token-sum":
            return (x * mask).sum()
        if mode == "seq-mean-token-mean":
            return ((x * mask).sum(-1) / (mask.sum(-1) + 1e-8)).sum() / size
        out = (x * mask).sum(-1).sum() / size
        return out / horizon if mode == "seq-mean-token-sum-norm" else out

    return agg(pg) + kl_coef * agg(kl)


def _case(seed=0, lens=(5, 3, 7, 1)):
    g = torch.Generator().manual_seed(seed)
    n, width = len(lens), max(lens) + 2
    mask = torch.zeros(n, width, dtype=torch.float64)
    for i, k in enumerate(lens):
        mask[i, :k] = 1
    logp = -2 + torch.randn(n, width, generator=g, dtype=torch.float64)
    old = logp - 1.5 * torch.randn(n, width, generator=g, dtype=torch.float64)  # ratios far outside 1 +- 0.2
    ref = logp + 0.5 * torch.randn(n, width, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    return lens, mask, logp, old, ref, adv


def _group_and_mb(lens, logp, old, ref, adv, rows):
    group = pf.RolloutGroup(
        prompt=torch.tensor([1, 2, 3]),
        responses=[torch.full((lens[r],), 4) for r in rows],
        advantages=adv[rows],
        old_logprobs=[old[r, : lens[r]] for r in rows],
        ref_logprobs=[ref[r, : lens[r]] for r in rows],
    )
    rid = torch.cat([torch.full((lens[r],), i) for i, r in enumerate(rows)])
    tid = torch.cat([torch.arange(lens[r]) for r in rows])
    empty = torch.zeros(0, dtype=torch.long)
    mb = Microbatch(empty[None], None, None, empty, empty, empty, rid, tid, tuple(range(len(rows))))
    flat = torch.cat([logp[r, : lens[r]] for r in rows])
    return group, mb, flat


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kl_type", KL)
def test_verl_loss_matches_its_definition_and_any_split(mode, kl_type):
    lens, mask, logp, old, ref, adv = _case()
    tokens, size, horizon = 40.0, 7.0, 9  # mini-batch-global: larger than this micro-batch
    want = _verl_reference(logp, old, ref, adv[:, None], mask, mode, kl_type, 0.3, 3.0, tokens, size, horizon)
    fields = dict(
        clip_eps_high=0.28, clip_ratio_c=3.0, log_ratio_clamp=20.0, kl_coef=0.3, kl_estimator=kl_type,
        aggregation=mode,
    )  # fmt: skip
    if mode == "token-mean":
        fields["batch_tokens"] = tokens
    elif mode != "token-sum":
        fields["batch_size"] = size
    if mode == "seq-mean-token-sum-norm":
        fields["norm_len"] = horizon
    if mode == "seq-mean-token-mean":
        fields["seq_len_eps"] = 1e-8
    cfg = LossConfig(**fields)
    for parts in ([[0, 1, 2, 3]], [[0, 2], [1], [3]]):  # one group, or a uid group split over micro-batches
        got = 0.0
        for rows in parts:
            group, mb, flat = _group_and_mb(lens, logp, old, ref, adv, rows)
            got = got + microbatch_loss(flat, mb, group, "grpo", resolve_loss("grpo", cfg, group))
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_dual_clip_binds_and_defaults_leave_the_loss_unchanged():
    lens, mask, logp, old, ref, adv = _case(seed=3)
    group, mb, flat = _group_and_mb(lens, logp, old, ref, adv, [0, 1, 2, 3])
    base = LossConfig(kl_coef=0.2)
    plain = microbatch_loss(flat, mb, group, "grpo", base)
    explicit = dataclasses.replace(
        base, clip_ratio_c=None, log_ratio_clamp=None, kl_estimator="k3", seq_len_eps=0.0
    )
    assert torch.equal(microbatch_loss(flat, mb, group, "grpo", explicit), plain)  # bit-identical
    dual = microbatch_loss(flat, mb, group, "grpo", dataclasses.replace(base, clip_ratio_c=1.5))
    assert abs(float(dual - plain)) > 1e-3  # some A < 0 token has ratio > 1.5 in this case


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "token-sum"])
def test_verl_options_are_schedule_and_microbatch_invariant(mode):
    model = tiny_model("qwen3")
    group = pf.synthetic_group(97, 14, [6, 11, 3, 8], seed=7, with_logprobs=True)
    group.old_logprobs = [lp - 0.4 * torch.arange(lp.numel(), dtype=lp.dtype) for lp in group.old_logprobs]
    cfg = dict(
        aggregation=mode, clip_ratio_c=1.5, log_ratio_clamp=20.0, kl_coef=0.2, kl_estimator="low_var_kl",
        batch_tokens=50.0 if mode == "token-mean" else None, batch_size=None if mode == "token-mean" else 6.0,
        seq_len_eps=1e-8 if mode == "seq-mean-token-mean" else 0.0,
    )  # fmt: skip
    runs = []
    for system, layout, microbatch in (("baseline", "padded", None), ("prefixflow", "packed", 1)):
        model.zero_grad(set_to_none=True)
        stats = pf.train_group(
            model, group, system=system, layout=layout, microbatch=microbatch, loss="grpo", loss_config=cfg
        )
        runs.append((stats.loss, [p.grad.clone() for p in model.parameters()]))
    (want_loss, want), (loss, got) = runs
    assert abs(loss - want_loss) <= 1e-12 * max(abs(want_loss), 1.0)
    assert max_rel_diff(got, want) <= 1e-9


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"clip_ratio_c": 1.0}, "clip_ratio_c"),
        ({"kl_estimator": "k3+"}, "kl_estimator"),
        ({"batch_tokens": 0}, "batch_tokens"),
        ({"batch_size": float("nan")}, "batch_size"),
        ({"log_ratio_clamp": -1.0}, "log_ratio_clamp"),
        ({"seq_len_eps": -1e-8}, "seq_len_eps"),
        ({"kl_estimator": "mse", "kl_ratio_correction": True}, "kl_ratio_correction"),
    ],
)
def test_bad_verl_fields_refused_naming_them(fields, match):
    group = pf.synthetic_group(97, 5, [3, 4], seed=0, with_logprobs=True)
    with pytest.raises(ValueError, match=match):
        resolve_loss("grpo", fields, group)


def test_verl_fields_refused_for_pg():
    group = pf.synthetic_group(97, 5, [3, 4], seed=0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        resolve_loss("pg", {"clip_ratio_c": 3.0}, group)
