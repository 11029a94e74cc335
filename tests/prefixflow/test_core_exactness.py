"""fp64: PrefixFlow and the baseline reproduce an independent full-sequence computation to <= 1e-9."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, tiny_model
from support.reference import max_rel_diff, reference_pg

import prefixflow as pf

TOL = 1e-9


def random_group(seed: int, vocab: int = 97, prompt_len: int | None = None, n: int | None = None, max_len=9):
    gen = torch.Generator().manual_seed(seed)
    prompt_len = prompt_len or int(torch.randint(2, 24, (1,), generator=gen))
    n = n or int(torch.randint(2, 6, (1,), generator=gen))
    lens = torch.randint(1, max_len + 1, (n,), generator=gen).tolist()
    return pf.synthetic_group(vocab, prompt_len, lens, seed=seed)


def grads(model):
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("system", ["prefixflow", "baseline"])
def test_matches_independent_full_sequence(family, ac, layout, system):
    model = tiny_model(family, ac=ac)
    for seed in range(2):
        group = random_group(seed)
        want_loss, want = reference_pg(model, group)
        for microbatch in (None, 1, 2):
            model.zero_grad(set_to_none=True)
            stats = pf.train_group(model, group, system=system, layout=layout, microbatch=microbatch)
            assert abs(stats.loss - want_loss) <= TOL * max(1.0, abs(want_loss))
            assert max_rel_diff(grads(model), want) <= TOL, (seed, microbatch)


def test_one_token_prompt_has_empty_cache_and_matches(family):
    model = tiny_model(family)
    group = random_group(3, prompt_len=1)
    want_loss, want = reference_pg(model, group)
    for layout in ("padded", "packed"):
        model.zero_grad(set_to_none=True)
        stats = pf.train_group(model, group, layout=layout, microbatch=2)
        assert stats.prefix_tokens == 0
        assert abs(stats.loss - want_loss) <= TOL * max(1.0, abs(want_loss))
        assert max_rel_diff(grads(model), want) <= TOL


def test_first_response_token_is_predicted_by_last_prompt_token(family):
    """Single-token responses: the whole loss lives at the prompt's last position (trap 1)."""
    model = tiny_model(family)
    group = pf.synthetic_group(97, 11, [1, 1, 1], seed=5)
    want_loss, want = reference_pg(model, group)
    model.zero_grad(set_to_none=True)
    stats = pf.train_group(model, group)
    assert stats.suffix_tokens == 3
    assert abs(stats.loss - want_loss) <= TOL * max(1.0, abs(want_loss))
    assert max_rel_diff(grads(model), want) <= TOL
    # The LM head received gradient only from the three predictions, so it is nonzero.
    assert model.output.weight.grad.abs().sum() > 0


def test_qwen3_without_qk_norm_matches():
    model = tiny_model("qwen3", qk_norm=False)
    group = random_group(7)
    want_loss, want = reference_pg(model, group)
    model.zero_grad(set_to_none=True)
    pf.train_group(model, group, layout="packed", microbatch=2)
    assert max_rel_diff(grads(model), want) <= TOL


def test_multi_head_attention_without_gqa_matches():
    model = tiny_model("llama3", n_kv_heads=4)
    group = random_group(8)
    _, want = reference_pg(model, group)
    model.zero_grad(set_to_none=True)
    pf.train_group(model, group)
    assert max_rel_diff(grads(model), want) <= TOL


def test_grpo_and_token_mean_agree_between_systems(family):
    model = tiny_model(family)
    group = pf.synthetic_group(97, 14, [3, 7, 2, 5], seed=11, with_logprobs=True)
    config = {"clip_eps_low": 0.05, "clip_eps_high": 0.08, "kl_coef": 0.1, "aggregation": "token-mean"}
    model.zero_grad(set_to_none=True)
    base = pf.train_group(model, group, system="baseline", loss="grpo", loss_config=config)
    want = [g.clone() for g in grads(model)]
    for layout, microbatch in (("padded", 1), ("packed", 3)):
        model.zero_grad(set_to_none=True)
        stats = pf.train_group(
            model, group, layout=layout, microbatch=microbatch, loss="grpo", loss_config=config
        )
        assert abs(stats.loss - base.loss) <= TOL * max(1.0, abs(base.loss))
        assert max_rel_diff(grads(model), want) <= TOL


def test_grpo_without_old_logprobs_equals_pg_gradient(family):
    """With old_logprobs=None the ratio is 1 (detached current policy), so the gradient is the pg one."""
    model = tiny_model(family)
    group = random_group(12)
    _, want = reference_pg(model, group)
    model.zero_grad(set_to_none=True)
    pf.train_group(model, group, loss="grpo")
    assert max_rel_diff(grads(model), want) <= TOL


def test_gradients_accumulate_across_groups(family):
    model = tiny_model(family)
    g1, g2 = random_group(20), random_group(21)
    _, w1 = reference_pg(model, g1)
    _, w2 = reference_pg(model, g2)
    model.zero_grad(set_to_none=True)
    pf.train_group(model, g1)
    pf.train_group(model, g2, layout="packed")
    assert max_rel_diff(grads(model), [a + b for a, b in zip(w1, w2, strict=True)]) <= TOL


def test_microbatch_split_does_not_rescale_loss(family):
    """Trap 5: per-token weights are fixed by the group, never renormalised per microbatch."""
    model = tiny_model(family)
    group = random_group(30, n=5)
    values = {mb: pf.train_group(model, group, microbatch=mb).loss for mb in (None, 1, 2, 5)}
    assert max(values.values()) - min(values.values()) <= 1e-12


def test_exact_rope_is_scoped_to_the_fp64_models_build_model_returns():
    """fp64 Llama3 models from build_model keep RoPE in fp64; TorchTitan's module and other models keep the
    original fp32 rounding (no global patch)."""
    import copy

    from torchtitan.models.llama3.model import model as llama3_model

    name, overrides = TINY["llama3"]
    original = llama3_model.apply_rotary_emb
    fp64 = pf.build_model(name, dtype=torch.float64, overrides=overrides)
    fp32 = pf.build_model(name, dtype=torch.float32, overrides=overrides)
    assert llama3_model.apply_rotary_emb is original and llama3_model.Attention.forward is not None
    assert "forward" not in vars(fp32.layers["0"].attention)  # the class's own forward

    class Spy(torch.nn.Module):  # records the post-RoPE queries the attention module hands on
        def __init__(self, inner):
            super().__init__()
            self.inner, self.seen = inner, []

        def forward(self, q, k, v, **kwargs):
            self.seen.append(q)
            return self.inner(q, k, v, **kwargs)

    def rotated_q(model):
        attention = model.layers["0"].attention
        inner = attention.inner_attention
        attention.inner_attention = spy = Spy(inner)
        x = torch.randn(1, 9, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        attention.to(torch.float64)(x, model.freqs_cis, None)
        attention.inner_attention = inner
        return spy.seen[0]

    q_exact = rotated_q(fp64)
    q_copy = rotated_q(copy.deepcopy(fp64))  # the binding survives a deep copy
    q_rounded = rotated_q(fp32)  # same weights (same seed), TorchTitan's rounding
    assert torch.equal(q_exact, q_copy)
    gap = float((q_exact - q_rounded).abs().max())
    assert 1e-12 < gap < 1e-5  # the fp32 rounding TorchTitan does, absent from the fp64 model
