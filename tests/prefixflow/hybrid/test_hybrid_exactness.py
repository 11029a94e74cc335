"""Hybrid HF models under ``train_group``: the recurrent state is the training-time cache, and the gradients equal
an independent full-sequence computation (transformers' own base model, one ``[P || S_i]`` at a time).

- Qwen3.5 (gated DeltaNet + gated full attention; GQA in both), and three Mamba-2 families: Nemotron-H (Mamba-2 +
  attention + MLP blocks, no positional encoding), Granite-4 hybrid (dense, RoPE, Granite's multipliers) and Bamba;
- fp64 with HF's fp32 casts patched to fp64 (norms, gated norm, gate ``.float()``, chunk/recurrent kernels):
  loss and every gradient within 1e-9 (max|d| / max|ref| per tensor);
- stock (unpatched) fp64: against the exact gradient, within twice HF's own stock error (the floor its fp32
  kernels set; docs/hybrid.md);
- padded and packed; microbatch 1, 2 and all; a response of one token; a prompt shorter than the conv kernel;
  a model with only linear-attention layers and one with a full-attention layer first; activation checkpointing.
"""

from __future__ import annotations

import functools
import gc
import weakref

import pytest
import torch

pytest.importorskip("transformers")

from support.hybrid import (  # noqa: E402
    VERIFIED_TRANSFORMERS,
    VOCAB,
    bamba,
    fp64_kernels,
    granite_hybrid,
    loss_scale,
    nemotron_h,
    qwen3_5,
    reference_pg,
    worst_grad,
)
from support.live_tensors import live_tensor_bytes  # noqa: E402

import prefixflow as pf  # noqa: E402
from prefixflow.integrations import hf  # noqa: E402,F401  (registers the HF adapter)

pytestmark = VERIFIED_TRANSFORMERS

LIN, FULL = "linear_attention", "full_attention"
MODELS = {
    "qwen3_5-mixed": (qwen3_5, (LIN, FULL, LIN)),
    "qwen3_5-full-first": (qwen3_5, (FULL, LIN)),
    "qwen3_5-linear-only": (qwen3_5, (LIN, LIN)),
    "nemotron_h": (nemotron_h, (LIN, FULL, "mlp")),
    "granite_hybrid": (granite_hybrid, ("mamba", "attention", "mamba")),
    "bamba": (lambda types: bamba([1], len(types)), (LIN, FULL)),
}
GROUP = pf.synthetic_group(VOCAB, 13, [5, 9, 1, 7], seed=3)
SHORT = pf.synthetic_group(VOCAB, 3, [4, 6], seed=5)  # 2 cached tokens < conv kernel - 1 = 3
ONE = pf.synthetic_group(VOCAB, 2, [1, 4, 6], seed=6)  # one cached token: a one-token prefix forward


def _check(model, group, layout, microbatch, tol) -> pf.GroupStats:
    ref_loss, ref_grads = reference_pg(model, group)
    pf.apply_prefixflow(model)
    model.zero_grad(set_to_none=True)
    stats = pf.train_group(model, group, layout=layout, microbatch=microbatch)
    loss_err = abs(stats.loss - ref_loss) / loss_scale(group)
    grad_err, name = worst_grad(model, ref_grads)
    assert loss_err <= tol, f"loss {loss_err:.2e}"
    assert grad_err <= tol, f"{name}: {grad_err:.2e}"
    return stats


@pytest.mark.parametrize("microbatch", [None, 1, 2])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_fp64_patched_exact(monkeypatch, name, layout, microbatch):
    fp64_kernels(monkeypatch)
    family, types = MODELS[name]
    stats = _check(family(types), GROUP, layout, microbatch, 1e-9)
    assert stats.prefix_tokens == GROUP.prompt_len - 1
    baseline_trunk = sum(
        len(c) * max(GROUP.prompt_len + GROUP.response_lens[i] - 1 for i in c)
        for c in _chunks(GROUP.n, microbatch)
    )
    if layout == "packed":
        baseline_trunk = sum(GROUP.prompt_len + s - 1 for s in GROUP.response_lens)
    assert stats.trunk_tokens < baseline_trunk


def _chunks(n, microbatch):
    size = n if microbatch is None else microbatch
    return [list(range(i, min(n, i + size))) for i in range(0, n, size)]


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name", ["qwen3_5-mixed", "nemotron_h"])
@pytest.mark.parametrize("group", [SHORT, ONE], ids=["2-cached", "1-cached"])
def test_fp64_patched_short_prompt(monkeypatch, name, layout, group):
    """A cached prefix shorter than the conv tail: the tail is left-padded with the conv's own zeros. One
    cached token: Phase A's forward is one token long (and so is a one-token response's suffix)."""
    fp64_kernels(monkeypatch)
    family, types = MODELS[name]
    _check(family(types), group, layout, 1, 1e-9)


@pytest.mark.parametrize("name", ["qwen3_5-mixed", "nemotron_h"])
def test_one_token_prompt(monkeypatch, name):
    """No prefix to cache: every recurrent layer starts from its zero state."""
    fp64_kernels(monkeypatch)
    family, types = MODELS[name]
    group = pf.synthetic_group(VOCAB, 1, [3, 5], seed=7)
    stats = _check(family(types), group, "packed", None, 1e-9)
    assert stats.prefix_tokens == 0


@functools.cache
def _stock_floor(name: str) -> tuple[float, list[torch.Tensor], float]:
    """The exact loss and gradients of ``MODELS[name]`` on ``GROUP`` (the full-sequence reference with HF's fp32
    casts patched to fp64), and the floor: how far HF's own stock full-sequence gradient is from them."""
    family, types = MODELS[name]
    model = family(types)
    with pytest.MonkeyPatch.context() as patch:
        fp64_kernels(patch)
        loss, exact = reference_pg(model, GROUP)
    reference_pg(model, GROUP)  # stock: the model's .grad now holds HF's own stock gradient
    return loss, exact, worst_grad(model, exact)[0]


@pytest.mark.parametrize("layout,microbatch", [("padded", 2), ("packed", 1)])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_fp64_stock_within_the_floor(name, layout, microbatch):
    """Stock transformers computes its norms, gates and chunked kernels in fp32 even in an fp64 model, so its own
    stock gradient is off the exact one by a floor (HF's full-sequence forward: 3e-7 to 1.4e-6 here, measured by
    ``scripts/hybrid_tolerance.py``); a stock reference cannot check PrefixFlow below that. Against the exact
    gradient, PrefixFlow's stock gradient may carry at most one more such error: within twice the floor."""
    loss, exact, floor = _stock_floor(name)
    family, types = MODELS[name]
    model = family(types)
    pf.apply_prefixflow(model)
    stats = pf.train_group(model, GROUP, layout=layout, microbatch=microbatch)
    assert 1e-8 < floor < 2e-6, f"the stock floor moved: {floor:.2e}"  # fp32 rounding, not a defect or exact
    grad_err, tensor = worst_grad(model, exact)
    assert grad_err <= 2 * floor, f"{tensor}: {grad_err:.2e} (floor {floor:.2e})"
    assert abs(stats.loss - loss) / loss_scale(GROUP) <= 1e-6


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name", ["qwen3_5-mixed", "nemotron_h"])
def test_activation_checkpointing(monkeypatch, name, layout):
    """HF's own non-reentrant checkpointing: Phase C recomputes the recurrent prefix blocks unchanged."""
    fp64_kernels(monkeypatch)
    family, types = MODELS[name]
    model = family(types)
    pf.apply_ac(model, "full")
    _check(model, GROUP, layout, 2, 1e-9)


@pytest.mark.parametrize("name", ["qwen3_5-mixed", "nemotron_h"])
def test_plain_forward_unchanged(name):
    """With no phase running, the recurrent layers run their own forward (generation, evaluation)."""
    family, types = MODELS[name]
    model = family(types)
    tokens = torch.cat([GROUP.prompt, GROUP.responses[1]]).unsqueeze(0)
    before = model.base_model(input_ids=tokens, use_cache=False).last_hidden_state
    pf.apply_prefixflow(model)
    after = model.base_model(input_ids=tokens, use_cache=False).last_hidden_state
    assert torch.equal(before, after)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name", ["qwen3_5-mixed", "nemotron_h"])
def test_groups_leave_no_state(monkeypatch, name, layout):
    """No state leaf, accumulator, conv tail or retained prefix graph survives a group: live tensor bytes
    after more groups equal those after the first, and every StateCache is empty and unreachable."""
    from prefixflow.state.recurrent import StateCache

    caches = []
    original = StateCache.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        caches.append(weakref.ref(self))

    monkeypatch.setattr(StateCache, "__init__", spy)
    family, types = MODELS[name]
    model = family(types)
    pf.apply_prefixflow(model)
    groups = [pf.synthetic_group(VOCAB, 12 + k, [3, 5, 2], seed=k) for k in range(3)]
    pf.train_group(model, groups[0], layout=layout)  # warm: grads allocated
    before = live_tensor_bytes()
    for group in groups[1:]:
        pf.train_group(model, group, layout=layout, microbatch=2)
    assert live_tensor_bytes() == before
    gc.collect()
    assert len(caches) == 3 and all(ref() is None for ref in caches)
    assert model._prefixflow.state.mode is None


@pytest.mark.parametrize("name", ["qwen3_5-mixed", "nemotron_h"])
def test_suffixes_read_the_leaves_expanded(monkeypatch, name):
    """Phase B hands every recurrent mixer the cached leaves themselves, expanded over the batch (stride 0),
    never a repeated copy."""
    from prefixflow.integrations.hf_state import BoundaryCache
    from prefixflow.state.recurrent import StateCache

    fp64_kernels(monkeypatch)
    leaves, seen = set(), []
    capture, init = StateCache.capture, BoundaryCache.__init__

    def spy_capture(self, layer, live):
        capture(self, layer, live)
        leaves.update(t.data_ptr() for t in self.layers[layer].leaves.values())

    def spy_init(self, initial, kernel):
        init(self, initial, kernel)
        if initial is not None:
            seen.extend(initial.values())

    monkeypatch.setattr(StateCache, "capture", spy_capture)
    monkeypatch.setattr(BoundaryCache, "__init__", spy_init)
    family, types = MODELS[name]
    model = family(types)
    pf.apply_prefixflow(model)
    pf.train_group(model, GROUP, layout="padded")
    assert seen and all(t.shape[0] == GROUP.n and t.stride(0) == 0 for t in seen)
    assert {t.data_ptr() for t in seen} <= leaves
