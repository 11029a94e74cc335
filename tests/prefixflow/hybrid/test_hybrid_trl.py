"""PrefixFlowGRPOTrainer trains Qwen3.5 (gated DeltaNet + attention): the same gradients as TRL's own
``compute_loss -> backward`` on one micro-batch, and the same SGD step as GRPOTrainer (fp32; TRL's default
gradient checkpointing on; TRL left-pads the prompts). The same fixtures as tests/prefixflow/integrations/test_trl.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

import support.trl_fixtures as F  # noqa: E402
from support.hybrid import VERIFIED_TRANSFORMERS  # noqa: E402
from support.reference import max_rel_diff  # noqa: E402

from prefixflow.integrations import hf  # noqa: E402
from prefixflow.integrations.trl import PrefixFlowGRPOTrainer  # noqa: E402
from prefixflow.state.recurrent import StateCache  # noqa: E402

pytestmark = VERIFIED_TRANSFORMERS


def qwen3_5_model(seed: int = 0):
    """hf:qwen3_5-tiny over the fixtures' vocabulary: larger q/k, GDN decay rates 0.05..0.5, a peaked head."""
    m = hf.build_hf_model(
        "qwen3_5-tiny",
        dtype=torch.float32,
        seed=seed,
        overrides={"vocab_size": len(F.SPECIALS) + len(F.WORDS)},
    )
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in m.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(4.0)
            elif name.endswith("A_log"):
                param.copy_((0.05 + 0.45 * torch.rand(param.shape, generator=gen)).log())
        m.lm_head.weight.mul_(8.0)
    m.generation_config.pad_token_id = 0
    m.generation_config.eos_token_id = 1
    return m


def trainer(tmp_path, cls=PrefixFlowGRPOTrainer, **config):
    return F.trainer(tmp_path, cls=cls, model=qwen3_5_model(), **config)


def test_micro_batch_gradients_equal_trl(tmp_path, monkeypatch):
    tr = trainer(tmp_path, loss_type="dapo")
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1
    torch.manual_seed(0)
    inputs = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    model = tr.model
    want_loss, want, got_loss, got = F.trl_and_prefixflow_grads(tr, inputs)
    assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    assert max_rel_diff(got, want) <= 1e-5
    # The check sees a fault: the recurrent states' gradients never reach the prefix.
    monkeypatch.setattr(StateCache, "roots", lambda self: ([], []))
    model.zero_grad(set_to_none=True)
    tr._prefixflow_update(model, inputs)
    assert max_rel_diff(F.grads(model), want) > 1e-3


def test_one_sgd_step_equals_grpo_trainer(tmp_path):
    steps = []
    for cls in (PrefixFlowGRPOTrainer.__mro__[1], PrefixFlowGRPOTrainer):
        tr = trainer(tmp_path / cls.__name__, cls=cls, loss_type="grpo")
        before = [p.detach().clone() for p in tr.model.parameters()]
        tr.train()
        after = [p.detach().clone() for p in tr.model.parameters()]
        steps.append((after, [a - b for a, b in zip(after, before, strict=True)]))
        if cls is PrefixFlowGRPOTrainer:
            logged = tr.state.log_history[0]
            assert logged["prefixflow/group_size"] == 4 and logged["prefixflow/prefix_tokens_reused"] > 0
    (base, base_step), (got, got_step) = steps
    assert max(float(s.abs().max()) for s in base_step) > 1e-3
    assert max_rel_diff(got, base) <= 1e-5
    assert max_rel_diff(got_step, base_step) <= 1e-4


def test_bf16_autocast_first_step_verifies(tmp_path):
    """TRL's default mixed precision (bf16 autocast over fp32 weights), packed suffixes: verify_first_step
    compares PrefixFlow's first update with TRL's own and passes within bf16 tolerance."""
    tr = PrefixFlowGRPOTrainer(
        model=qwen3_5_model(),
        reward_funcs=F.reward_even_words,
        args=F.config(tmp_path, bf16=True, loss_type="dapo"),
        train_dataset=F.dataset(),
        processing_class=F.tokenizer(),
        prefixflow_layout="packed",
        verify_first_step=True,
    )
    tr.train()
    assert tr._prefixflow_verified
    assert 0 < tr.state.log_history[0]["prefixflow/verify_max_rel_diff"] <= 5e-2
