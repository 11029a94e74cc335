"""Issue 36.1 / 36.3 / 36.8: the trainer's own options are refused at construction, a non-finite first-step
difference fails the check, and trees on hybrid models keep shared nodes of at least 2 tokens."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("trl")

import support.hybrid as H  # noqa: E402
import support.trl_fixtures as F  # noqa: E402
from support.reference import max_rel_diff  # noqa: E402

from prefixflow import PrefixFlowConfig, RolloutTree  # noqa: E402
from prefixflow.integrations.trl import sharding  # noqa: E402


@pytest.mark.parametrize(
    "options, text",
    [
        (dict(verify_tolerance=float("nan")), "verify_tolerance must be a finite number > 0"),
        (dict(verify_tolerance=float("inf")), "verify_tolerance must be a finite number > 0"),
        (dict(verify_tolerance=-1e-3), "verify_tolerance must be a finite number > 0"),
        (dict(verify_tolerance=0.0), "verify_tolerance must be a finite number > 0"),
        (dict(verify_tolerance=True), "verify_tolerance must be a finite number > 0"),
        (dict(prefixflow_microbatch=0), "prefixflow_microbatch must be None .all completions., an int >= 1"),
        (dict(prefixflow_microbatch=1.5), "prefixflow_microbatch must be None"),
        (dict(prefixflow_microbatch="auto"), "prefixflow_microbatch='auto' needs a memory budget"),
        (dict(prefixflow_min_shared_tokens=0), "prefixflow_min_shared_tokens must be an int >= 1 or 'auto'"),
        (dict(prefixflow_tree=1), "prefixflow_tree must be True, False or 'auto'"),
    ],
)
def test_bad_options_are_refused_at_construction(tmp_path, options, text):
    model = F.model()
    with pytest.raises(ValueError, match=text) as err:
        F.trainer(tmp_path, model=model, **options)
    assert "\n" not in str(err.value)
    assert all(p.grad is None for p in model.parameters())


def test_auto_microbatch_with_a_budget_is_accepted(tmp_path):
    config = PrefixFlowConfig(memory_budget_bytes=1 << 30)
    tr = F.trainer(tmp_path, prefixflow_microbatch="auto", prefixflow_config=config)
    assert tr.prefixflow_microbatch == "auto"


def test_a_non_finite_difference_fails_the_first_step_check(tmp_path, monkeypatch):
    """``worst > tolerance`` is False for NaN: a NaN difference used to pass as verified."""
    tr = F.trainer(tmp_path, loss_type="grpo", verify_first_step=True)
    monkeypatch.setattr(sharding, "worst_rel_diff", lambda *a, **k: (math.nan, "lm_head.weight"))
    with pytest.raises(RuntimeError, match=r"differs from TRL's: max relative gradient difference nan"):
        tr.train()
    assert not tr._prefixflow_verified


def _hybrid():
    model = H.qwen3_5(("linear_attention", "linear_attention", "full_attention"))
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    return model


def _one_token_branch_batch() -> dict:
    """Two prompts, completions that share one token after the prompt and then branch: the tree's shared
    node after the prompt is one token long."""
    prompt = torch.tensor([[0, 5, 6, 7], [0, 5, 6, 7], [9, 10, 11, 12], [9, 10, 11, 12]])
    return {
        "prompt_ids": prompt,
        "prompt_mask": (prompt != 0).long() | torch.tensor([[0, 1, 1, 1]] * 2 + [[1, 1, 1, 1]] * 2),
        "completion_ids": torch.tensor([[20, 21, 22], [20, 23, 24], [30, 31, 32], [33, 34, 35]]),
        "completion_mask": torch.ones(4, 3, dtype=torch.long),
        "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5]),
    }


@H.VERIFIED_TRANSFORMERS
def test_trees_on_a_hybrid_keep_two_token_nodes_and_equal_flat_groups(tmp_path, monkeypatch):
    """Qwen3.5 (gated DeltaNet), fp64: the trainer's trees use min_shared_tokens=2 (a one-token shared node was
    refused inside train()), and train what flat groups do."""
    H.fp64_kernels(monkeypatch)
    grads = {}
    for tree in (True, False):
        tr = F.trainer(tmp_path / str(tree), model=_hybrid(), loss_type="grpo", prefixflow_tree=tree)
        tr.current_gradient_accumulation_steps = 1
        assert tr.prefixflow_min_shared_tokens == 2
        inputs = _one_token_branch_batch()
        (unit,) = tr._plan(inputs) if tree else tr._plan(inputs)[:1]
        assert isinstance(unit.group, RolloutTree) == tree
        tr.model.zero_grad(set_to_none=True)
        tr._prefixflow_update(tr.model, inputs)
        grads[tree] = [p.grad.clone() for p in tr.model.parameters() if p.grad is not None]
    assert max_rel_diff(*grads.values()) <= 1e-10
    with pytest.raises(ValueError, match="prefixflow_min_shared_tokens=1: this model has recurrent layers"):
        F.trainer(tmp_path / "one", model=_hybrid(), prefixflow_min_shared_tokens=1)
