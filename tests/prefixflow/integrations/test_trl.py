"""PrefixFlowGRPOTrainer against TRL's GRPOTrainer: the same loss and gradients, and the same optimizer step.

Everything is local: a WordLevel tokenizer, a tiny HF model with random weights, four prompts of different
lengths (TRL left-pads them), completions of different lengths (EOS grows likelier with length). fp32.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

import support.trl_fixtures as F  # noqa: E402
from support.reference import max_rel_diff  # noqa: E402
from support.trl_fixtures import micro_batch, trainer  # noqa: E402

from prefixflow.integrations.trl import PrefixFlowGRPOTrainer, plan_groups  # noqa: E402

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


CASES = {
    "grpo-token-kl-biascorr-temp": dict(loss_type="grpo", beta=0.04, temperature=0.7, epsilon_high=0.28),
    "bnpo-sequence-packed": dict(
        loss_type="bnpo",
        importance_sampling_level="sequence",
        epsilon=0.1,
        prefixflow_layout="packed",
        prefixflow_microbatch=1,
    ),
    "dr_grpo-kl-nocorr-delta": dict(loss_type="dr_grpo", beta=0.1, use_bias_correction_kl=False, delta=1.2),
    "dapo-ga2": dict(
        loss_type="dapo", gradient_accumulation_steps=2, steps_per_generation=2, epsilon_high=0.28
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_and_gradients_equal_trl_compute_loss(tmp_path, case):
    """TRL's own ``compute_loss -> backward`` and PrefixFlow's update on the same micro-batch."""
    options = dict(CASES[case])
    beta = options.pop("beta", 0.0)
    tr = trainer(tmp_path, **options)
    inputs = micro_batch(tr)
    tr.beta = beta  # no reference model is needed: its log-probs are injected into the micro-batch
    assert len(set(inputs["completion_mask"].sum(-1).tolist())) > 1, "completions should differ in length"
    if case.startswith("bnpo"):
        inputs["completion_mask"][3] = 0  # a fully masked completion (mask_truncated_completions)
    model = tr.model
    want_loss, want, got_loss, got = F.trl_and_prefixflow_grads(tr, inputs)
    assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    assert max_rel_diff(got, want) <= 1e-5
    plans = tr._plan(inputs)
    assert sorted(len(p.rows) for p in plans) != [1] * len(plans)  # prompts really share completions
    if case.startswith("bnpo"):  # every completion masked: both add zero gradients, no error
        inputs["completion_mask"][:] = 0
        model.zero_grad(set_to_none=True)
        assert float(tr._prefixflow_update(model, inputs)) == 0.0 and tr._plan(inputs) == []
        assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_one_optimizer_step_equals_grpo_trainer(tmp_path, loss_type):
    """Same model, data and seed: one SGD step of GRPOTrainer and of PrefixFlowGRPOTrainer."""
    params = {}
    for cls in (PrefixFlowGRPOTrainer.__mro__[1], PrefixFlowGRPOTrainer):
        tr = trainer(tmp_path / cls.__name__, cls=cls, loss_type=loss_type)
        before = [p.detach().clone() for p in tr.model.parameters()]
        tr.train()
        after = [p.detach().clone() for p in tr.model.parameters()]
        params[cls] = (after, [a - b for a, b in zip(after, before, strict=True)])
        logged = tr.state.log_history[0]
        assert tr.model.model.layers[0].gradient_checkpointing  # TRL's default, on in both trainers
        if cls is PrefixFlowGRPOTrainer:  # the update really ran train_group: 2 prompts x 4 completions
            assert logged["prefixflow/group_size"] == 4 and logged["prefixflow/prefix_tokens_reused"] > 0
        else:
            assert "prefixflow/group_size" not in logged
    (base, base_step), (pf, pf_step) = params.values()
    assert max_rel_diff(pf, base) <= 1e-5
    assert max(float(s.abs().max()) for s in base_step) > 1e-3  # the step really moved the weights
    assert max_rel_diff(pf_step, base_step) <= 1e-4  # SGD: the update is the gradient, compared directly


def test_verify_first_step_passes_and_catches_a_wrong_update(tmp_path, monkeypatch):
    tr = trainer(tmp_path, model=F.model("llama"), loss_type="grpo")
    tr.verify_first_step = True
    tr.train()
    assert tr._prefixflow_verified
    broken = trainer(tmp_path / "broken", model=F.model("llama"), loss_type="grpo")
    broken.verify_first_step = True
    real = broken._plan

    def doubled(inputs):
        plans = real(inputs)
        for plan in plans:
            object.__setattr__(
                plan,
                "loss_config",
                plan.loss_config.__class__(
                    **{**plan.loss_config.__dict__, "group_weight": 2 * plan.loss_config.group_weight}
                ),
            )
        return plans

    monkeypatch.setattr(broken, "_plan", doubled)
    with pytest.raises(RuntimeError, match="differs from TRL's"):
        broken.train()


def test_bf16_autocast_first_step_verifies_in_fp32(tmp_path):
    """TRL's default mixed precision (bf16 autocast over fp32 weights), packed suffixes: the check runs both paths
    in fp32 (measured 6e-7 against its 1e-4 tolerance), then the update runs in bf16."""
    tr = trainer(tmp_path, bf16=True, loss_type="dapo", prefixflow_layout="packed")
    tr.verify_first_step = True
    tr.train()
    assert tr._prefixflow_verified
    assert 0 < tr.state.log_history[0]["prefixflow/verify_max_rel_diff"] <= 1e-5


def test_bf16_first_step_check_catches_gkv_scaled_by_0_99(tmp_path):
    """Negative control: the prefix gradient (gK/gV) scaled by 0.99 fails the fp32 check under bf16 training."""
    import prefixflow as pf
    from prefixflow.checks.faults import ScalePrefixGradient

    tr = trainer(tmp_path, bf16=True, loss_type="dapo")
    tr.verify_first_step = True
    pf.add_hooks(tr.model, ScalePrefixGradient(0.99))
    with pytest.raises(RuntimeError, match="differs from TRL's"):
        tr.train()


def test_unsupported_options_raise_at_construction(tmp_path):
    for options, text in (
        (dict(top_entropy_quantile=0.5), "top_entropy_quantile < 1.0 .the entropy mask needs"),
        (dict(entropy_coef=0.01), "entropy_coef / use_adaptive_entropy .the entropy bonus needs"),
    ):
        with pytest.raises(ValueError, match=text):
            trainer(tmp_path, **options)
    with pytest.raises(ValueError, match="prefixflow_tree must be True, False or 'auto'"):
        trainer(tmp_path, prefixflow_tree="yes")


def test_plan_rejects_inputs_it_cannot_reproduce():
    base = dict(
        loss_type="grpo",
        beta=0.0,
        epsilon_low=0.2,
        epsilon_high=0.2,
        delta=None,
        importance_sampling_level="token",
        use_bias_correction_kl=True,
        temperature=1.0,
        max_completion_length=4,
        gradient_accumulation_steps=1,
    )
    inputs = {
        "prompt_ids": torch.tensor([[0, 5, 6], [0, 5, 6]]),
        "prompt_mask": torch.tensor([[0, 1, 1], [0, 1, 1]]),
        "completion_ids": torch.tensor([[7, 8, 9], [7, 9, 0]]),
        "completion_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
        "advantages": torch.tensor([1.0, -1.0]),
    }
    (plan,) = plan_groups(inputs, **base)
    assert plan.rows == [0, 1] and plan.group.prompt.tolist() == [5, 6]
    assert plan.group.response_lens == [3, 2] and plan.loss_config.group_weight == 1.0
    assert plan.loss_config.batch_size == 2  # TRL's B: grpo's mean over the micro-batch's completions
    gaps = {**inputs, "completion_mask": torch.tensor([[1, 0, 1], [1, 1, 0]])}
    with pytest.raises(ValueError, match="has gaps"):
        plan_groups(gaps, **base)
    with pytest.raises(ValueError, match="importance_sampling_ratio"):
        plan_groups({**inputs, "importance_sampling_ratio": torch.ones(2, 3)}, **base)
    with pytest.raises(ValueError, match="one value per completion"):
        plan_groups({**inputs, "advantages": torch.ones(2, 3)}, **base)


def test_trl_metrics_are_logged_every_step(tmp_path):
    """Issue 26.6: TRL's kl, entropy and clip_ratio/* are logged on every step, as GRPOTrainer logs them."""
    logs = {}
    path = F.saved_model(tmp_path / "model")  # beta > 0: TRL loads its reference model from the path
    for cls in (PrefixFlowGRPOTrainer.__mro__[1], PrefixFlowGRPOTrainer):
        tr = trainer(
            tmp_path / cls.__name__, cls=cls, model=path, loss_type="grpo", beta=0.04, max_steps=3,
            learning_rate=0.05,
        )  # fmt: skip
        tr.train()
        logs[cls] = [h for h in tr.state.log_history if "loss" in h]
    base, pf = logs.values()
    keys = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
    assert len(pf) == 3
    for step, (b, p) in enumerate(zip(base, pf, strict=True)):
        for key in keys:
            assert key in p, (step, key)
            assert p[key] == pytest.approx(b[key], rel=1e-3, abs=1e-6), (step, key)
    assert pf[2]["kl"] > 0


def test_prompt_beyond_max_position_embeddings_names_the_hf_field(tmp_path):
    """Issue 26.6: the hint names config.max_position_embeddings (not TorchTitan's max_seq_len)."""
    model = F.model()
    model.config.max_position_embeddings = 12
    tr = trainer(tmp_path, model=model, loss_type="grpo")
    with pytest.raises(
        ValueError, match=r"exceeds the model's config.max_position_embeddings=12; lower"
    ) as err:
        tr.train()
    assert "max_seq_len" not in str(err.value)
