"""fp64: the ``split`` suffix attention (cache read in place, LSE merge) equals ``concat`` and the baseline."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _reference import max_rel_diff
from conftest import TINY, tiny_model

import prefixflow as pf
from prefixflow.split_attention import split_attention, split_attention_reference, suffix_bias

TOL = 1e-12


def concat_attention(q, k, v, prefix_k, prefix_v, suffix_mask, scale):
    b = q.shape[0]
    keys = torch.cat([prefix_k.expand(b, -1, -1, -1), k], dim=2)
    values = torch.cat([prefix_v.expand(b, -1, -1, -1), v], dim=2)
    visible = torch.ones(b, 1, q.shape[2], prefix_k.shape[2], dtype=torch.bool)
    mask = torch.cat([visible, suffix_mask.expand(b, -1, -1, -1)], dim=-1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)


def rel(a, b):
    return float((a - b).detach().abs().max() / b.detach().abs().max())


@pytest.mark.parametrize("impl", [split_attention, split_attention_reference])
@pytest.mark.parametrize(
    "b,s,p,causal", [(1, 7, 5, True), (3, 6, 9, False), (2, 5, 1, True), (2, 8, 4, False)]
)
def test_kernel_matches_concat_with_gradients(impl, b, s, p, causal):
    gen = torch.Generator().manual_seed(b * 100 + s)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_(True)

    q, k, v = rand(b, 4, s, 8), rand(b, 2, s, 8), rand(b, 2, s, 8)
    prefix_k, prefix_v = rand(1, 2, p, 8), rand(1, 2, p, 8)
    mask = torch.ones(s, s, dtype=torch.bool).tril().expand(b, 1, s, s).clone()
    if not causal:  # packed-like holes; every row keeps its diagonal
        mask[0, 0, -1, :-1] = False
        mask[-1, 0, 3:, :2] = False
    inputs = (q, k, v, prefix_k, prefix_v)
    grad_out = torch.randn(b, 4, s, 8, generator=gen, dtype=torch.float64)
    want = concat_attention(*inputs, mask, 0.3)
    got = impl(*inputs, mask, scale=0.3)
    assert rel(got, want) <= TOL
    for g, w in zip(
        torch.autograd.grad(got, inputs, grad_out), torch.autograd.grad(want, inputs, grad_out), strict=True
    ):
        assert g.shape == w.shape
        assert rel(g, w) <= TOL


def test_suffix_bias_detects_plain_causal():
    causal = torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 1, 5, 5)
    assert suffix_bias(causal, torch.float32) == (None, True)
    holes = causal.clone()
    holes[1, 0, 4, 0] = False
    bias, is_causal = suffix_bias(holes, torch.float32)
    assert not is_causal and bias.dtype == torch.float32
    assert torch.isinf(bias[1, 0, 4, 0]) and int(torch.isinf(bias).sum()) == 2 * 10 + 1


def test_batch_prefix_must_be_shared():
    x = torch.zeros(2, 2, 3, 4)
    with pytest.raises(ValueError, match="batch size 1"):
        split_attention(x, x, x, x, x, None)


def test_config_rejects_unknown_variant():
    with pytest.raises(ValueError, match="split"):
        pf.PrefixFlowConfig(attention="nope")


def train(model, group, attention, system, layout, microbatch):
    pf.apply_prefixflow(model, pf.PrefixFlowConfig(attention=attention))
    model.zero_grad(set_to_none=True)
    stats = pf.train_group(model, group, system=system, layout=layout, microbatch=microbatch)
    return stats.loss, [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("family", sorted(TINY))
def test_split_gradients_equal_concat_and_baseline(family, layout):
    model = tiny_model(family)  # GQA: 4 query heads over 2 KV heads
    group = pf.synthetic_group(97, 13, [5, 9, 1, 7], seed=11)
    base_loss, base = train(model, group, "concat", "baseline", layout, None)
    for microbatch in (None, 1, 3):
        concat_loss, concat = train(model, group, "concat", "prefixflow", layout, microbatch)
        split_loss, split = train(model, group, "split", "prefixflow", layout, microbatch)
        assert abs(split_loss - concat_loss) <= TOL * max(1.0, abs(concat_loss))
        assert abs(split_loss - base_loss) <= TOL * max(1.0, abs(base_loss))
        assert max_rel_diff(split, concat) <= TOL, microbatch
        assert max_rel_diff(split, base) <= TOL, microbatch


def test_split_uses_no_concat(monkeypatch):
    """The split variant never builds ``[prefix ; suffix]`` K/V: no cat in the attention call."""
    model = tiny_model("llama3")
    group = pf.synthetic_group(97, 9, [4, 6], seed=2)
    seen = []
    real_cat = torch.cat

    def spy(tensors, dim=0, **kw):
        if dim == 2 and len(tensors) == 2 and tensors[0].dim() == 4:
            seen.append(tuple(t.shape for t in tensors))
        return real_cat(tensors, dim=dim, **kw)

    monkeypatch.setattr(torch, "cat", spy)
    train(model, group, "split", "prefixflow", "padded", None)
    assert seen == []
    train(model, group, "concat", "prefixflow", "padded", None)
    assert len(seen) == 2 * 2  # K and V in each of 2 layers
