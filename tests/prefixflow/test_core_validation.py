"""Bad input: a clear error naming the field, raised before any gradient changes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import tiny_model

import prefixflow as pf

P = torch.tensor([1, 2, 3, 4])
R = [torch.tensor([5, 6]), torch.tensor([7])]
A = torch.tensor([0.5, -0.5])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"responses": []}, ValueError, "responses is empty"),
        ({"responses": [torch.tensor([], dtype=torch.long)]}, ValueError, r"responses\[0\] is empty"),
        ({"prompt": torch.tensor([], dtype=torch.long)}, ValueError, "prompt is empty"),
        ({"prompt": torch.tensor([1.0, 2.0])}, TypeError, "prompt must hold integer token ids"),
        ({"prompt": [1, 2]}, TypeError, "prompt must be a torch.LongTensor"),
        (
            {"responses": [torch.tensor([5, -1]), torch.tensor([7])]},
            ValueError,
            r"responses\[0\] has negative",
        ),
        (  # the group's responses are checked together; the error still names the one at fault
            {"responses": [torch.tensor([5, 6]), torch.tensor([7, -2], dtype=torch.int32)]},
            ValueError,
            r"responses\[1\] has negative token ids \(min -2\)",
        ),
        ({"responses": torch.tensor([[5, 6]])}, TypeError, "responses must be a list"),
        ({"advantages": torch.tensor([1.0, 2.0, 3.0])}, ValueError, r"advantages must have shape \(2,\)"),
        ({"advantages": torch.tensor([1.0, float("nan")])}, ValueError, "advantages must be finite"),
        ({"old_logprobs": [torch.zeros(2)]}, ValueError, "old_logprobs must be a list of 2"),
        (
            {"old_logprobs": [torch.zeros(2), torch.zeros(3)]},
            ValueError,
            r"old_logprobs\[1\] has shape \(3,\)",
        ),
        (
            {"ref_logprobs": [torch.zeros(2), torch.tensor([float("inf")])]},
            ValueError,
            r"ref_logprobs\[1\] must be finite",
        ),
        (
            {"old_logprobs": [torch.tensor([0.0, float("nan")]), torch.zeros(1, dtype=torch.float64)]},
            ValueError,
            r"old_logprobs\[0\] must be finite",
        ),
    ],
)
def test_malformed_group_is_rejected(kwargs, error, match):
    fields = {"prompt": P, "responses": R, "advantages": A, **kwargs}
    with pytest.raises(error, match=match):
        pf.RolloutGroup(**fields)


@pytest.fixture(scope="module")
def trained_model():
    """A model whose grads are already populated, so 'untouched' is a real check."""
    model = tiny_model("llama3")
    pf.train_group(model, pf.RolloutGroup(P, R, A))
    return model


@pytest.mark.parametrize(
    "group_kwargs, call_kwargs, match",
    [
        (
            {"responses": [torch.tensor([5, 97]), torch.tensor([7])]},
            {},
            r"responses\[0\] has token id 97 outside",
        ),
        (
            {"responses": [torch.tensor([5, 6]), torch.tensor([98])]},
            {},
            r"responses\[1\] has token id 98 outside",
        ),
        ({"prompt": torch.tensor([100, 2])}, {}, "prompt has token id 100 outside"),
        ({}, {"system": "fast"}, "system 'fast' unknown"),
        ({}, {"layout": "ragged"}, "layout 'ragged' unknown"),
        ({}, {"loss": "dpo"}, "loss 'dpo' unknown"),
        ({}, {"microbatch": 0}, "microbatch must be None"),
        ({}, {"microbatch": 1.5}, "microbatch must be None"),
        ({}, {"loss": "grpo", "loss_config": {"eps": 0.2}}, r"loss_config has unknown key\(s\) \['eps'\]"),
        ({}, {"loss": "grpo", "loss_config": {"kl_coef": 0.1}}, "needs group.ref_logprobs"),
        ({}, {"loss": "grpo", "loss_config": {"aggregation": "sum"}}, "aggregation 'sum' unknown"),
        ({}, {"loss": "grpo", "loss_config": {"clip_eps_low": "0.2"}}, "clip_eps_low must be a finite"),
        ({}, {"loss": "grpo", "loss_config": {"kl_coef": float("nan")}}, "kl_coef must be a finite number"),
        ({}, {"loss": "grpo", "loss_config": {"clip_eps_high": -0.1}}, "must be >= 0"),
    ],
)
def test_bad_call_leaves_gradients_untouched(trained_model, group_kwargs, call_kwargs, match):
    model = trained_model
    group = pf.RolloutGroup(**{"prompt": P, "responses": R, "advantages": A, **group_kwargs})
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        pf.train_group(model, group, **call_kwargs)
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.grad, b)
    assert model._prefixflow.state.mode is None


def test_sequence_longer_than_max_seq_len_is_rejected_untouched():
    model = tiny_model("qwen3", max_seq_len=16)
    pf.train_group(model, pf.RolloutGroup(P, R, A))
    before = [p.grad.clone() for p in model.parameters()]
    group = pf.RolloutGroup(P, [torch.ones(13, dtype=torch.long), torch.tensor([7])], A)
    with pytest.raises(ValueError, match=r"= 17 tokens exceeds the model's max_seq_len=16"):
        pf.train_group(model, group)
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))
    # 16 tokens exactly is fine.
    pf.train_group(model, pf.RolloutGroup(P, [torch.ones(12, dtype=torch.long), torch.tensor([7])], A))


def test_train_group_needs_apply_prefixflow():
    model = pf.build_model(
        "llama3:debugmodel", overrides={"dim": 32, "n_layers": 1, "n_heads": 2, "vocab_size": 97}
    )
    with pytest.raises(ValueError, match="call prefixflow.apply_prefixflow"):
        pf.train_group(model, pf.RolloutGroup(P, R, A))


def test_not_a_group_is_a_type_error(trained_model):
    with pytest.raises(TypeError, match="group must be a prefixflow.RolloutGroup"):
        pf.train_group(trained_model, {"prompt": P})


@pytest.mark.parametrize(
    "name, overrides, match",
    [
        ("gpt2", None, "must look like 'family:flavor'"),
        ("mamba:small", None, "unknown model family 'mamba'"),
        ("llama3:9000B", None, "unknown llama3 flavor '9000B'"),
        ("llama3:debugmodel", {"head_dim": 16}, r"unknown override field\(s\) \['head_dim'\]"),
        ("qwen3:debugmodel", {"n_layer": 2}, r"unknown override field\(s\) \['n_layer'\]"),
        ("llama3:debugmodel", {"dim": "64"}, "override dim='64' has type str"),
        ("llama3:debugmodel", {"n_heads": 4, "n_kv_heads": 3}, "must be a multiple of n_kv_heads"),
    ],
)
def test_bad_model_names_and_fields(name, overrides, match):
    with pytest.raises(ValueError, match=match):
        pf.build_model(name, overrides=overrides)


def test_unknown_model_error_lists_valid_names():
    with pytest.raises(ValueError) as info:
        pf.build_model("llama3:nope")
    assert "debugmodel" in str(info.value) and "8B" in str(info.value)


def test_config_attention_variant_is_validated_and_auto_resolves_by_device():
    with pytest.raises(ValueError, match=r"attention 'flash' unknown; valid: \('auto', 'concat', 'split'\)"):
        pf.PrefixFlowConfig(attention="flash")
    auto = pf.PrefixFlowConfig()
    assert auto.attention == "auto"
    assert auto.attention_for(torch.device("cpu")) == "split"
    assert auto.attention_for(torch.device("cuda")) == "concat"
    assert pf.PrefixFlowConfig(attention="concat").attention_for(torch.device("cpu")) == "concat"


@pytest.mark.parametrize(
    ("loss", "cfg", "text"),
    [  # issue 26, defect 9: both were accepted
        ("grpo", {"aggregation": "seq-mean-token-sum-norm", "norm_len": 2}, r"norm_len=2 is shorter than the longest response \(3 trained tokens\)"),
        ("pg", {"clip_eps_high": 0.28}, r"\['clip_eps_high'\] apply to loss='grpo' only"),
        ("pg", {"kl_coef": 0.1, "clip_eps_low": 0.1}, r"\['clip_eps_low', 'kl_coef'\] apply to loss='grpo' only"),
    ],
)  # fmt: skip
def test_norm_len_below_a_response_and_grpo_keys_with_pg_are_refused(loss, cfg, text):
    model = tiny_model("llama3")
    group = pf.synthetic_group(97, 6, [3, 2], seed=1, with_logprobs=True)
    with pytest.raises(ValueError, match=text):
        pf.train_group(model, group, loss=loss, loss_config=cfg)
    assert all(p.grad is None for p in model.parameters())
    ok = {"aggregation": "seq-mean-token-sum-norm", "norm_len": 3}
    pf.train_group(model, group, loss="grpo", loss_config=ok)  # the bound itself is fine
    pf.train_group(model, group, loss="pg", loss_config={"clip_eps_low": 0.2, "temperature": 1.5})  # defaults


def test_norm_len_bounds_trained_tokens_not_masked_context():
    """Tool output under a loss mask is context: a response may run past norm_len (TRL's
    max_completion_length) in tokens as long as its trained tokens fit."""
    model = tiny_model("llama3")
    group = pf.synthetic_group(97, 6, [5, 2], seed=1, with_logprobs=True)
    masked = dataclasses.replace(group, loss_masks=[torch.tensor([1, 1, 0, 0, 1], dtype=torch.bool),
                                                    torch.ones(2, dtype=torch.bool)])  # fmt: skip
    cfg = {"aggregation": "seq-mean-token-sum-norm", "norm_len": 3}
    with pytest.raises(ValueError, match=r"norm_len=3 is shorter than the longest response \(5 trained"):
        pf.train_group(model, group, loss="grpo", loss_config=cfg)
    pf.train_group(model, masked, loss="grpo", loss_config=cfg)
