"""TRL's GRPO training-test configurations (read in TRL's ``tests/test_grpo_trainer.py``, not copied) that run
on CPU with a local text model: each one trained with TRL's GRPOTrainer and with PrefixFlowGRPOTrainer from the
same model, data and seed, then compared (weights after the steps, and the update; SGD, fp32).

Covered here or in the sibling modules: every loss type (test_trl_losses), ``beta`` with a reference model
(test_trl: metrics), LoRA (test_trl_peft), tools/environments (test_trl_tools), gradient accumulation
(test_trl, test_trl_ddp), several reward functions with weights, a reward model, conversational prompts,
``mask_truncated_completions`` (and an all-masked micro-batch: test_trl), ``num_generations`` above the
per-device batch, ``delta`` clipping, sequence importance sampling with ``num_iterations=2``.

Left out, and why: vLLM (generation server or colocated engine: not installed, GPU), liger kernels (not
installed; TRL refuses them with its fused LM head), vision-language models (test_trl_vlm), the
entropy mask and entropy bonus (refused: they need every token's full-vocabulary entropy before the loss),
DeepSpeed/FSDP through accelerate (GPU states only; refused), ``use_transformers_paged``/continuous batching
and ``cast_lm_head_to_fp32`` on GPU-only paths, ``sync_ref_model`` (a callback on TRL's side: unchanged, not
re-tested), tests that only check TRL's own logging/saving/evaluation code paths.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

import support.trl_fixtures as F  # noqa: E402
from support.reference import max_rel_diff  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from prefixflow.integrations.trl import PrefixFlowGRPOTrainer  # noqa: E402


def reward_length(completions, **kwargs):
    return [
        min(len(c if isinstance(c, str) else c[0]["content"]).__float__() / 40.0, 1.0) for c in completions
    ]


def _reward_model(tmp_path):
    """A tiny sequence-classification twin (one label) as a reward model, with the same tokenizer."""
    from transformers import AutoModelForSequenceClassification

    from prefixflow.integrations import hf

    config = hf.hf_config("qwen2-tiny", {"vocab_size": len(F.SPECIALS) + len(F.WORDS)})
    config.num_labels, config.pad_token_id = 1, 0
    torch.manual_seed(5)
    return AutoModelForSequenceClassification.from_config(config)


def _conversational():
    from datasets import Dataset

    rows = F.dataset()["prompt"]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in rows]})


def _tokenizer_with_template():
    tok = F.tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tok


CASES = {
    "several-rewards-weighted": dict(reward_funcs="several", reward_weights=[1.0, 0.5]),
    "reward-model": dict(reward_funcs="model"),
    "conversational": dict(conversational=True),
    "mask-truncated": dict(mask_truncated_completions=True, max_completion_length=4),
    "num-generations-above-batch": dict(
        num_generations=8,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        steps_per_generation=2,
    ),
    "delta": dict(loss_type="grpo", delta=1.01, num_iterations=2, max_steps=2),
    "sequence-is-2-iterations": dict(
        loss_type="grpo", importance_sampling_level="sequence", num_iterations=2, max_steps=2, epsilon=0.001
    ),
    "beta-no-bias-correction": dict(loss_type="bnpo", beta=0.1, use_bias_correction_kl=False),
}


def _trainer(tmp_path, cls, case):
    options = dict(CASES[case])
    rewards = options.pop("reward_funcs", None)
    tok = F.tokenizer()
    data = F.dataset()
    if options.pop("conversational", False):
        tok, data = _tokenizer_with_template(), _conversational()
    extra = {}
    if rewards == "several":
        funcs = [F.reward_even_words, reward_length]
    elif rewards == "model":
        funcs = [_reward_model(tmp_path), F.reward_even_words]
        extra["reward_processing_classes"] = [F.tokenizer(), None]
    else:
        funcs = F.reward_even_words
    model = F.model() if options.get("beta", 0.0) == 0.0 else F.saved_model(tmp_path / "model")
    return cls(
        model=model, reward_funcs=funcs, args=F.config(tmp_path / cls.__name__, **options), train_dataset=data,
        processing_class=tok, **extra,
    )  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_trl_configuration_equals_grpo_trainer(tmp_path, case):
    runs = {}
    for cls in (GRPOTrainer, PrefixFlowGRPOTrainer):
        tr = _trainer(tmp_path, cls, case)
        params = [p for p in tr.model.parameters() if p.requires_grad]
        before = [p.detach().clone() for p in params]
        tr.train()
        after = [p.detach().clone() for p in params]
        runs[cls] = (after, [a - b for a, b in zip(after, before, strict=True)], tr.state.log_history)
    (base, base_step, base_log), (pf, pf_step, pf_log) = runs.values()
    assert max(float(s.abs().max()) for s in base_step) > 1e-4, "the steps moved the weights"
    assert max_rel_diff(pf, base) <= 1e-5
    assert max_rel_diff(pf_step, base_step) <= 1e-4
    assert any("prefixflow/group_size" in h for h in pf_log)
    if case == "mask-truncated":  # some completions really were truncated, hence masked out
        assert base_log[0]["completions/clipped_ratio"] > 0
