"""Multi-turn rollouts with tool output (TRL's ``tool_mask``), and prefix trees, against TRL's own step.

The rollouts come through TRL's environment path (``rollout_func`` returning ``env_mask``, which TRL turns into
``tool_mask``): assistant turn, tool output (no loss), assistant turn. Completions 2k and 2k+1 of a prompt share
their first turn and its tool output, so the trainer's prefix tree has shared multi-turn nodes. A second data set
puts one system prompt in front of every prompt (a forest root shared across prompts).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

import support.trl_fixtures as F  # noqa: E402
from support.reference import max_rel_diff  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from prefixflow import RolloutGroup, RolloutTree  # noqa: E402

LOSSES = {
    "grpo": dict(loss_type="grpo", beta=0.04),
    "dapo": dict(loss_type="dapo", epsilon_high=0.28),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "vespo": dict(loss_type="vespo"),
    "sapo": dict(loss_type="sapo", beta=0.04),
    "cispo": dict(loss_type="cispo", epsilon_high=1.1),
    "grpo-offpolicy": dict(loss_type="grpo", off_policy_mask_threshold=0.0),
}


def _tools_trainer(tmp_path, dtype=torch.float32, **options):
    beta = options.pop("beta", 0.0)
    model = F.model("qwen3", dtype=dtype)
    if dtype == torch.float64:
        F.fp64_norms(model)
    tr = F.trainer(tmp_path, model=model, rollout_func=F.multi_turn_rollout, **options)
    inputs = F.micro_batch(tr)
    tr.beta = beta
    return tr, inputs


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("case", sorted(LOSSES))
def test_tool_masked_completions_equal_trl(tmp_path, case, tree):
    """Tool output is context, never trained: flat groups with ``loss_masks`` and the prefix tree, fp32."""
    tr, inputs = _tools_trainer(tmp_path, prefixflow_tree=tree, **LOSSES[case])
    mask = inputs["tool_mask"] * inputs["completion_mask"]
    assert (mask != inputs["completion_mask"]).any(), "some completion tokens should be tool output"
    want_loss, want, got_loss, got = F.trl_and_prefixflow_grads(tr, inputs)
    assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    assert max_rel_diff(got, want) <= 1e-5
    plans = tr._plan(inputs)
    kind = RolloutTree if tree else RolloutGroup
    assert all(isinstance(p.group, kind) for p in plans)


@pytest.mark.parametrize("case", ["grpo", "vespo", "luspo"])
def test_tool_masked_tree_equals_trl_fp64(tmp_path, monkeypatch, case):
    F.fp64_trl(monkeypatch)
    tr, inputs = _tools_trainer(tmp_path, dtype=torch.float64, **LOSSES[case])
    want_loss, want, got_loss, got = F.trl_and_prefixflow_grads(tr, inputs)
    assert got_loss == pytest.approx(want_loss, rel=1e-9, abs=1e-12)
    assert max_rel_diff(got, want) <= 1e-9


def test_shared_multi_turn_prefix_builds_one_tree(tmp_path):
    """'auto' builds a tree for tool rollouts; completions sharing a turn share a node below the prompt."""
    tr, inputs = _tools_trainer(tmp_path, loss_type="dapo")
    (plan,) = tr._plan(inputs)
    tree = plan.group
    assert isinstance(tree, RolloutTree) and tree.n == 8
    shared_turns = [j for j in range(tree.n_nodes) if tree.parents[j] >= 0 and len(tree.children[j]) >= 2]
    assert shared_turns, "a multi-turn prefix below the prompt is shared"
    assert tree.unique_tokens < sum(tree.path_lens)


@pytest.mark.parametrize("tree", ["auto", False])
def test_shared_system_prompt_builds_one_tree_across_prompts(tmp_path, tree):
    tr = F.trainer(tmp_path, dataset=F.system_dataset(), loss_type="grpo", prefixflow_tree=tree)
    inputs = F.micro_batch(tr)
    plans = tr._plan(inputs)
    if tree == "auto":
        (plan,) = plans
        roots = [j for j in range(plan.group.n_nodes) if plan.group.parents[j] < 0]
        assert len(roots) == 1 and len(plan.group.children[roots[0]]) >= 2  # the system prompt, once
    else:
        assert len(plans) == 2 and all(isinstance(p.group, RolloutGroup) for p in plans)
    want_loss, want, got_loss, got = F.trl_and_prefixflow_grads(tr, inputs)
    assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    assert max_rel_diff(got, want) <= 1e-5


def test_all_tool_output_completion_adds_nothing(tmp_path):
    """A completion whose every token is tool output counts in B (grpo) and trains nothing, as in TRL."""
    tr, inputs = _tools_trainer(tmp_path, loss_type="grpo")
    inputs["tool_mask"][2] = 0
    want_loss, want, got_loss, got = F.trl_and_prefixflow_grads(tr, inputs)
    assert max_rel_diff(got, want) <= 1e-5
    assert 2 not in tr._plan(inputs)[0].rows


def test_training_tool_tokens_is_caught(tmp_path):
    """Negative control: dropping the tool mask (tool output trained) moves the gradient far past 1e-5."""
    tr, inputs = _tools_trainer(tmp_path, loss_type="dapo")
    model = tr.model
    model.zero_grad(set_to_none=True)
    tr.compute_loss(model, inputs).backward()
    want = F.grads(model)
    model.zero_grad(set_to_none=True)
    tr._prefixflow_update(model, {k: v for k, v in inputs.items() if k != "tool_mask"})
    assert max_rel_diff(F.grads(model), want) > 1e-2


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_one_sgd_step_with_an_environment_equals_grpo_trainer(tmp_path, loss_type):
    """TRL's GRPOTrainer and PrefixFlowGRPOTrainer, same rollout_func, model and seed: one SGD step."""
    params = {}
    for cls in (GRPOTrainer, None):
        tr = F.trainer(tmp_path / str(cls), cls=cls, rollout_func=F.multi_turn_rollout, loss_type=loss_type)
        before = [p.detach().clone() for p in tr.model.parameters()]
        tr.train()
        after = [p.detach().clone() for p in tr.model.parameters()]
        params[cls] = (after, [a - b for a, b in zip(after, before, strict=True)])
        if cls is None:
            assert tr.state.log_history[0]["prefixflow/trees"] == 1
            assert tr.state.log_history[0]["prefixflow/prefix_tokens_reused"] > 0  # the trie's shared tokens
    (base, base_step), (pf, pf_step) = params.values()
    assert max(float(s.abs().max()) for s in base_step) > 1e-3
    assert max_rel_diff(pf, base) <= 1e-5
    assert max_rel_diff(pf_step, base_step) <= 1e-4
