"""The TRL loss options of ``prefixflow.loss`` (no TRL needed): schedule- and microbatch-invariant, validated.

Their agreement with TRL's own ``_compute_loss`` is tested in ``test_trl.py``; here the same objective must come
out of every schedule (PrefixFlow, baseline), layout and microbatch split, in fp64 on a TorchTitan model.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from support.reference import max_rel_diff

import prefixflow as pf

OPTIONS = {
    "sequence-is": dict(importance_sampling="sequence", clip_eps_low=0.05, clip_eps_high=0.05),
    "kl-ratio-temperature": dict(kl_coef=0.3, kl_ratio_correction=True, temperature=0.6),
    "dr_grpo-delta": dict(
        aggregation="seq-mean-token-sum-norm", norm_len=40, ratio_cap=1.05, group_weight=0.25
    ),
    "seq-sum": dict(aggregation="seq-mean-token-sum", clip_eps_high=0.28),
    "cispo": dict(policy="cispo", cispo_cap=1.05, aggregation="token-sum", group_weight=0.1),
    "sapo": dict(policy="sapo", sapo_tau_pos=0.7, sapo_tau_neg=1.4, kl_coef=0.1),
    "vespo": dict(policy="vespo", aggregation="token-mean", batch_tokens=50.0),
    "off-policy-mask": dict(off_policy_threshold=0.05, batch_size=6.0),
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_trl_options_are_schedule_and_microbatch_invariant(name):
    model = tiny_model("qwen3")
    group = pf.synthetic_group(97, 14, [6, 11, 3, 8], seed=7, with_logprobs=True)
    # old log-probs far from the policy: ratios leave the clip range, so every branch of the loss is used
    group.old_logprobs = [lp - 0.2 * torch.arange(lp.numel(), dtype=lp.dtype) for lp in group.old_logprobs]
    cfg = OPTIONS[name]
    runs = []
    for system, layout, microbatch in (
        ("baseline", "padded", None),
        ("prefixflow", "padded", None),
        ("prefixflow", "packed", 1),
        ("baseline", "packed", 3),
    ):
        model.zero_grad(set_to_none=True)
        stats = pf.train_group(
            model, group, system=system, layout=layout, microbatch=microbatch, loss="grpo", loss_config=cfg
        )
        runs.append((stats.loss, [p.grad.clone() for p in model.parameters()]))
    want_loss, want = runs[0]
    assert any(g.abs().max() > 0 for g in want)
    for loss, got in runs[1:]:
        assert abs(loss - want_loss) <= 1e-12 * max(abs(want_loss), 1.0)
        assert max_rel_diff(got, want) <= 1e-9


def test_group_weight_scales_and_temperature_changes_the_objective():
    model = tiny_model("llama3")
    group = pf.synthetic_group(97, 9, [4, 5], seed=2, with_logprobs=True)
    values = {}
    for key, cfg in {"base": {}, "half": {"group_weight": 0.5}, "hot": {"temperature": 2.0}}.items():
        model.zero_grad(set_to_none=True)
        values[key] = pf.train_group(model, group, loss="grpo", loss_config=cfg).loss
    assert values["half"] == pytest.approx(values["base"] / 2, rel=1e-12)
    assert values["hot"] != pytest.approx(values["base"], rel=1e-3)


@pytest.mark.parametrize(
    ("cfg", "text"),
    [
        ({"aggregation": "seq-mean-token-sum-norm"}, "needs norm_len"),
        ({"norm_len": 8}, "only used by aggregation"),
        ({"importance_sampling": "tokens"}, "importance_sampling 'tokens' unknown"),
        ({"temperature": 0.0}, "temperature must be a finite number > 0"),
        ({"temperature": float("inf")}, "temperature must be a finite number > 0"),
        ({"group_weight": float("nan")}, "group_weight must be a finite number"),
        ({"ratio_cap": -1.0}, "ratio_cap must be None or a finite number > 0"),
        ({"kl_ratio_correction": 1}, "kl_ratio_correction must be a bool"),
        ({"policy": "ppo"}, "policy 'ppo' unknown"),
        ({"policy": "cispo"}, "needs cispo_cap"),
        ({"sapo_tau_pos": 2.0}, "sapo_tau_pos applies to policy='sapo' only"),
        ({"policy": "sapo", "sapo_tau_neg": 0.0}, "must be > 0"),
        ({"policy": "vespo", "importance_sampling": "sequence"}, "use importance_sampling='token'"),
        ({"policy": "cispo", "cispo_cap": 2.0, "ratio_cap": 1.5}, "apply to policy='clip' only"),
        ({"off_policy_threshold": float("nan")}, "off_policy_threshold must be None or a finite number"),
    ],
)
def test_trl_options_are_validated_before_gradients_change(cfg, text):
    model = tiny_model("llama3")
    group = pf.synthetic_group(97, 6, [3, 2], seed=1, with_logprobs=True)
    with pytest.raises(ValueError, match=text):
        pf.train_group(model, group, loss="grpo", loss_config=cfg)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="apply to loss='grpo' only"):
        pf.train_group(model, group, loss="pg", loss_config={"importance_sampling": "sequence"})
    with pytest.raises(ValueError, match="apply to loss='grpo' only"):
        pf.train_group(model, group, loss="pg", loss_config={"policy": "sapo"})
