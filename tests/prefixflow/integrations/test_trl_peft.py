"""LoRA through PEFT (``peft_config=LoraConfig(...)`` on q/k/v/o and the MLP) against TRL + PEFT's own step.

The cache boundary is unchanged (LoRA sits inside the projections, before RoPE and the attention PrefixFlow
wraps), so the adapter gradients must equal TRL's. With ``beta`` > 0, TRL's reference log-probs come from the
same model with its adapter disabled. ``init_lora_weights=False``: A and B both random, so both get gradients.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
peft = pytest.importorskip("peft")

import support.trl_fixtures as F  # noqa: E402
from support.reference import max_rel_diff  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora():
    return peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=False
    )


def lora_params(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "sapo", "cispo"])
def test_lora_adapter_gradients_equal_trl_peft(tmp_path, loss_type):
    tr = F.trainer(tmp_path, loss_type=loss_type, peft_config=lora())
    inputs = F.micro_batch(tr)
    tr.beta = 0.04
    trained = lora_params(tr.model)
    assert len(trained) == 2 * 2 * len(TARGETS) and all("lora_" in n for n, _ in trained)
    want_loss, want, got_loss, got = F.trl_and_prefixflow_grads(tr, inputs)
    assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    assert min(float(w.abs().max()) for w in want) > 0  # every A and B gets a gradient
    assert max_rel_diff(got, want) <= 1e-5


def test_lora_adapter_gradients_equal_trl_peft_fp64_tree(tmp_path, monkeypatch):
    """fp64, HF norms and TRL's LM head in fp64, multi-turn tool rollouts through a prefix tree."""
    F.fp64_trl(monkeypatch)
    model = F.model(dtype=torch.float64)
    F.fp64_norms(model)
    tr = F.trainer(
        tmp_path, model=model, loss_type="grpo", peft_config=lora(), rollout_func=F.multi_turn_rollout
    )
    inputs = F.micro_batch(tr)
    want_loss, want, got_loss, got = F.trl_and_prefixflow_grads(tr, inputs)
    assert got_loss == pytest.approx(want_loss, rel=1e-9, abs=1e-12)
    assert max_rel_diff(got, want) <= 1e-9


def test_a_wrong_adapter_scale_is_caught(tmp_path):
    """Negative control: LoRA's scaling 5% off in PrefixFlow's pass moves the adapter gradients past 1e-3."""
    tr = F.trainer(tmp_path, loss_type="dapo", peft_config=lora())
    inputs = F.micro_batch(tr)
    model = tr.model
    model.zero_grad(set_to_none=True)
    tr.compute_loss(model, inputs).backward()
    want = F.grads(model)
    model.zero_grad(set_to_none=True)
    layers = [m for m in model.modules() if isinstance(getattr(m, "scaling", None), dict)]
    for m in layers:
        m.scaling = {k: v * 1.05 for k, v in m.scaling.items()}
    tr._prefixflow_update(model, inputs)
    assert max_rel_diff(F.grads(model), want) > 1e-3


def test_one_sgd_step_with_lora_and_a_disabled_adapter_reference_equals_trl(tmp_path):
    """beta > 0: both trainers take the reference log-probs through the disabled adapter; one SGD step."""
    steps, refs = {}, {}
    for cls in (GRPOTrainer, None):
        tr = F.trainer(tmp_path / str(cls), cls=cls, loss_type="grpo", beta=0.04, peft_config=lora())
        assert tr.ref_model is None  # PEFT: the reference is the base model, adapter disabled
        before = [p.detach().clone() for _, p in lora_params(tr.model)]
        real = tr._prepare_inputs
        tr._prepare_inputs = lambda batch, real=real, cls=cls: refs.setdefault(cls, real(batch))
        tr.train()
        after = [p.detach().clone() for _, p in lora_params(tr.model)]
        steps[cls] = (after, [a - b for a, b in zip(after, before, strict=True)])
        if cls is None:
            assert tr.state.log_history[0]["prefixflow/group_size"] == 4
    # the reference log-probs are the base model's: a fresh copy of it (no adapter) gives the same values
    inputs = refs[None]
    base = F.model()
    with torch.no_grad():
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        logits = base(input_ids=ids, attention_mask=mask).logits[
            :, -inputs["completion_ids"].shape[1] - 1 : -1
        ]
        want_ref = (
            torch.log_softmax(logits, -1).gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
        )
    cm = inputs["completion_mask"].bool()
    assert torch.allclose(inputs["ref_per_token_logps"][cm], want_ref[cm], atol=1e-4)
    (base_after, base_step), (pf_after, pf_step) = steps.values()
    assert max(float(s.abs().max()) for s in base_step) > 1e-3
    assert max_rel_diff(pf_after, base_after) <= 1e-5
    assert max_rel_diff(pf_step, base_step) <= 1e-4
