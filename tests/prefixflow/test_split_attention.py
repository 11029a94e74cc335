"""fp64: the ``split`` suffix attention (cache read in place, LSE merge) equals ``concat`` and the baseline."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, tiny_model
from support.reference import max_rel_diff

import prefixflow as pf
from prefixflow.attention.split import split_attention, split_attention_reference, suffix_bias

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


def test_reference_is_finite_on_a_fully_masked_suffix_row():
    """A query row with no visible suffix key (and an empty prefix share) gives finite output and gradients."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    prefix = torch.randn(1, 2, 2, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool).tril()
    mask[0, 0, 1] = False  # row 1 sees no suffix key (only the prefix)
    out = split_attention_reference(q, k, k, prefix, prefix, mask)
    want = concat_attention(q, k, k, prefix, prefix, mask, 0.5)
    assert torch.isfinite(out).all() and rel(out, want) <= TOL
    grads = torch.autograd.grad(out.sum(), (q, k, prefix))
    assert all(torch.isfinite(g).all() for g in grads)
    # and with no prefix key either (a fully masked row overall): zeros, like the fused kernels
    empty = prefix[:, :, :0]
    out = split_attention_reference(q, k, k, empty, empty, mask)
    assert torch.isfinite(out).all() and torch.equal(out[0, :, 1], torch.zeros_like(out[0, :, 1]))
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out.sum(), (q, k)))


@pytest.mark.parametrize("ac", ["selective", "full"])
@pytest.mark.parametrize("attention", ["concat", "split"])
def test_both_variants_equal_the_baseline_under_activation_checkpointing(attention, ac):
    model = tiny_model("llama3", ac=ac)
    group = pf.synthetic_group(97, 11, [4, 7, 2], seed=4)
    _, base = train(model, group, attention, "baseline", "padded", None)
    for layout in ("padded", "packed"):
        _, got = train(model, group, attention, "prefixflow", layout, 2)
        assert max_rel_diff(got, base) <= TOL, layout


def test_masked_calls_run_under_the_models_sdpa_backend_list(monkeypatch):
    """Concat's and the packed baseline's masked SDPA calls run under the backend list of the model's own
    attention (TorchTitan's ScaledDotProductAttentionWrapper.sdpa_backends), as its causal calls do."""
    from torch.nn.attention import SDPBackend

    import prefixflow.attention.modes as attention_module

    model = tiny_model("llama3")
    for wrapper in model._prefixflow.state.wrappers:
        wrapper.inner.sdpa_backends = [SDPBackend.MATH]
    seen = []
    real = attention_module.F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.flash_sdp_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", spy)
    group = pf.synthetic_group(97, 9, [4, 6], seed=2)
    train(model, group, "concat", "prefixflow", "padded", None)
    train(model, group, "concat", "baseline", "packed", None)
    # Phase A's layer 0 (TorchTitan's own call; layer 1 stops at its K/V), then 2 layers x (concat Phase B,
    # packed baseline): all with flash off, as the list says
    assert len(seen) == 1 + 2 * 2 and not any(seen)
    assert torch.backends.cuda.flash_sdp_enabled()  # restored outside


class _FakeCudaAten:
    """ATen's CUDA flash / memory-efficient SDPA signatures (torch 2.13), computed in plain ops on CPU, so the
    split path's glue for them (argument order, GQA expansion, lse padding, saved state) runs without a GPU.
    Like the real kernels: flash takes GQA K/V, efficient needs equal heads and pads its lse rows to 32."""

    @staticmethod
    def _scores(q, k, bias, is_causal, scale):
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
        if bias is not None:
            s = s + bias
        if is_causal:
            s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
        return s

    def _fwd(self, q, k, v, bias, is_causal, scale):
        s = self._scores(q, k, bias, is_causal, scale)
        lse = torch.logsumexp(s, -1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return torch.einsum("bhqk,bhkd->bhqd", torch.exp(s - lse.unsqueeze(-1)), v), lse

    def _bwd(self, do, q, k, v, bias, out, lse, is_causal, scale):
        rep = q.shape[1] // k.shape[1]
        p = torch.exp(self._scores(q, k, bias, is_causal, scale) - lse.unsqueeze(-1))
        ve = v.repeat_interleave(rep, dim=1)
        dv = torch.einsum("bhqk,bhqd->bhkd", p, do)
        ds = p * (torch.einsum("bhqd,bhkd->bhqk", do, ve) - (do * out).sum(-1, keepdim=True))
        dq = torch.einsum("bhqk,bhkd->bhqd", ds, k.repeat_interleave(rep, dim=1)) * scale
        dk = torch.einsum("bhqk,bhqd->bhkd", ds, q) * scale
        fold = lambda g: g.view(g.shape[0], k.shape[1], rep, *g.shape[2:]).sum(2)  # noqa: E731
        return dq, fold(dk), fold(dv)

    def _scaled_dot_product_flash_attention(self, q, k, v, dropout, is_causal, debug, *, scale):
        out, lse = self._fwd(q, k, v, None, is_causal, scale)
        empty = torch.empty(0)
        return out, lse, empty, empty, q.shape[2], k.shape[2], torch.zeros(2), torch.zeros(1), empty

    def _scaled_dot_product_flash_attention_backward(self, do, q, k, v, out, lse, cq, ck, mq, mk, dropout,
                                                      is_causal, rng, unused, *, scale):  # fmt: skip
        assert (mq, mk) == (q.shape[2], k.shape[2]) and rng.shape == (2,) and unused.shape == (1,)
        return self._bwd(do, q, k, v, None, out, lse, is_causal, scale)

    def _scaled_dot_product_efficient_attention(
        self, q, k, v, bias, compute_lse, dropout, is_causal, *, scale
    ):
        assert q.shape[1] == k.shape[1] and compute_lse
        assert bias is None or (bias.shape == (*q.shape[:3], k.shape[2]) and bias.stride(-1) == 1)
        out, lse = self._fwd(q, k, v, bias, is_causal, scale)
        padded = torch.zeros(*lse.shape[:2], -(-lse.shape[2] // 32) * 32, dtype=lse.dtype)
        padded[..., : lse.shape[2]] = lse
        return out, padded, torch.zeros(()), torch.zeros(())

    def _scaled_dot_product_efficient_attention_backward(self, do, q, k, v, bias, out, lse, seed, offset,
                                                          dropout, mask, is_causal, *, scale):  # fmt: skip
        assert q.shape[1] == k.shape[1] and lse.shape[2] % 32 == 0 and list(mask) == [True, True, True, False]
        return (*self._bwd(do, q, k, v, bias, out, lse[..., : q.shape[2]], is_causal, scale), None)


@pytest.mark.parametrize("kernel", ["flash_cuda", "flash_cuda_expanded", "efficient_cuda"])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_kernel_glue_matches_concat(monkeypatch, kernel, causal):
    """Split's CUDA kernels (driven by fake ATen ops with the real signatures) give concat's output and
    gradients: GQA expansion and its gradient fold, lse slicing/padding, the saved forward state."""
    import prefixflow.attention.split as sa

    if kernel.startswith("flash") and not causal:
        pytest.skip("flash takes no bias; a masked suffix part goes to the efficient kernel")
    monkeypatch.setattr(sa, "_aten", _FakeCudaAten())
    monkeypatch.setattr(sa, "_kernel_for", lambda *a: kernel)
    gen = torch.Generator().manual_seed(9)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_(True)

    q, k, v, pk, pv = rand(3, 4, 6, 8), rand(3, 2, 6, 8), rand(3, 2, 6, 8), rand(1, 2, 5, 8), rand(1, 2, 5, 8)
    mask = torch.ones(6, 6, dtype=torch.bool).tril().expand(3, 1, 6, 6).clone()
    if not causal:
        mask[1, 0, 4:, :2] = False
    got = sa.split_attention(q, k, v, pk, pv, mask, scale=0.3, prepared=sa.suffix_bias(mask, q.dtype))
    want = concat_attention(q, k, v, pk, pv, mask, 0.3)
    assert rel(got, want) <= TOL
    grad = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    inputs = (q, k, v, pk, pv)
    for g, w in zip(
        torch.autograd.grad(got, inputs, grad), torch.autograd.grad(want, inputs, grad), strict=True
    ):
        assert g.shape == w.shape and rel(g, w) <= TOL


def test_rows_that_see_no_cached_key_get_an_empty_prefix_part():
    """A tree microbatch can hold a row that reads no cached node beside rows that do (a forest: a root's
    leaf row next to a child's). Its prefix part is empty: forward and backward equal SDPA over the
    concatenated keys under the whole mask (the fused kernel's fully masked rows are not empty)."""
    from prefixflow.attention.split import split_attention

    gen = torch.Generator().manual_seed(0)
    b, s, d, p = 3, 4, 8, 5

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)

    q, k, v, pk, pv = rand(b, 4, s, d), rand(b, 2, s, d), rand(b, 2, s, d), rand(1, 2, p, d), rand(1, 2, p, d)
    keys = torch.ones(b, 1, s, p, dtype=torch.bool)
    keys[0] = False  # row 0 reads no cached node
    keys[2, ..., :2] = False  # row 2 reads only the second node
    own = torch.ones(s, s, dtype=torch.bool).tril().expand(b, 1, s, s)
    grad = torch.randn(b, 4, s, d, generator=gen, dtype=torch.float64)
    results = []
    for split in (True, False):
        for t in (q, k, v, pk, pv):
            t.grad = None
        if split:
            out = split_attention(q, k, v, pk, pv, None, keys_mask=keys)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(
                q, torch.cat([pk.expand(b, -1, -1, -1), k], 2), torch.cat([pv.expand(b, -1, -1, -1), v], 2),
                attn_mask=torch.cat([keys, own], -1), enable_gqa=True,
            )  # fmt: skip
        out.backward(grad)
        results.append([out.detach(), *(t.grad.clone() for t in (q, k, v, pk, pv))])
    for got, want in zip(*results, strict=True):
        assert float((got - want).abs().max()) <= 1e-12 * float(want.abs().max())
