"""harness.costmodel.flops: executed FLOPs by hand, against FlopCounterMode and the attention pairs that run, the
ideal speedup, the paper's §3.1 model, and TorchTitan's own count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.costmodel.flops import (
    AttentionCounter,
    as_shape,
    count_flops,
    dense_flops_per_token,
    executed_flops,
    ideal_speedup,
    least_prefixflow_flops,
    model_flops,
    paper_ideal_speedup,
    speedup_terms,
)
from harness.costmodel.shape import ModelShape

TINY = ModelShape(dim=4, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=2, hidden_dim=8, vocab_size=10)
LLAMA8B = ModelShape(
    dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, hidden_dim=14336, vocab_size=128256
)


def test_tiny_shape_by_hand():
    # per token and layer: q 2*4*4=32, k 16, v 16 (qkv 64), o 32, mlp 6*4*8=192 -> 288; pair 4*2*2=16; head 80
    assert (TINY.qkv, TINY.kv, TINY.layer, TINY.pair, TINY.head) == (64, 32, 288, 16, 80)
    P, S, N = 3, 2, 2
    # baseline, padded, one sequence each: 4 tokens, 10 causal pairs, head at 2 positions; x3 (fwd + bwd)
    base = N * 3 * (4 * 2 * 288 + 2 * 80 + 10 * 2 * 16)
    assert model_flops("baseline", TINY, P, S, N, microbatch=1) == base
    # prefixflow: T=2 cached tokens. Phase A/C: layer 0 full (3*2*288, 3 pairs), layer 1 q/k/v forward
    # (2*64) and k/v backward (2*2*32); Phase B: 2 suffix tokens x 2 layers, 2*2 prefix pairs + 3 own pairs
    prefix = 3 * 2 * 288 + 2 * (64 + 2 * 32) + 3 * 3 * 16
    suffix = 3 * (2 * 2 * 288 + 2 * 80) + 3 * 2 * (4 + 3) * 16
    split = executed_flops("prefixflow", TINY, P, S, N, microbatch=1, attention="split")
    assert split.total == prefix + N * suffix
    # concat computes the suffix's causal upper triangle too: 2*(2+2) pairs per layer instead of 4+3
    concat = executed_flops("prefixflow", TINY, P, S, N, microbatch=1, attention="concat")
    assert concat.attention - split.attention == N * 3 * 2 * 1 * 16 and concat.gemm == split.gemm
    assert least_prefixflow_flops(TINY, P, S, N) == split
    assert ideal_speedup(TINY, P, S, N) == pytest.approx(base / split.total)


def test_ideal_exceeds_the_papers_by_the_dead_last_layer_work():
    """The paper's model charges the prefix forward and backward in every layer: on 2 layers that bound is
    far too low; on 32 layers the two nearly agree."""
    two = ModelShape(
        dim=256, n_layers=2, n_heads=16, n_kv_heads=16, head_dim=16, hidden_dim=768, vocab_size=2048
    )
    assert paper_ideal_speedup(two, 1280, 256, 1) == pytest.approx(1.0, abs=1e-3)
    assert ideal_speedup(two, 1280, 256, 1) > 1.45  # N=1: PrefixFlow skips a third of the baseline
    assert ideal_speedup(two, 1280, 256, 16) > 1.05 * paper_ideal_speedup(two, 1280, 256, 16)
    deep = ideal_speedup(LLAMA8B, 10240, 2048, 16) / paper_ideal_speedup(LLAMA8B, 10240, 2048, 16)
    assert 1.0 < deep < 1.05


def test_paper_speedup_limits():
    for P, S in [(512, 512), (10240, 2048), (2, 100)]:
        assert paper_ideal_speedup(LLAMA8B, P, S, 1) == pytest.approx(1.0, abs=1e-4)
    assert paper_ideal_speedup(LLAMA8B, 512, 512, 1, overhead=0.5) == pytest.approx(1 / 1.5, rel=1e-4)
    P, S = 10240, 2048
    t = speedup_terms(LLAMA8B, P, S)
    assert t["p"] + t["s"] == pytest.approx(1.0)
    assert paper_ideal_speedup(LLAMA8B, P, S, 10**7) == pytest.approx(1 / (t["s"] + t["a"]), rel=1e-5)
    r = P / (P + S)
    assert t["s"] > 1 - r  # the suffix also attends over the prefix
    assert paper_ideal_speedup(LLAMA8B, P, S, 16) > 3.8  # the paper's eager 10k/2k point: 3.800x at N=16


def test_ideal_is_monotone_in_n_and_prefix_ratio():
    prev = 0.0
    for P in (256, 512, 768, 1024, 1280):
        values = [ideal_speedup(LLAMA8B, P, 1536 - P, n) for n in (1, 2, 4, 8, 16, 32)]
        assert all(b > a for a, b in zip(values, values[1:], strict=False))
        assert values[-1] > prev
        prev = values[-1]


def test_bad_inputs():
    with pytest.raises(ValueError):
        model_flops("nope", TINY, 3, 2, 1)
    with pytest.raises(ValueError):
        model_flops("baseline", TINY, 0, 2, 1)
    with pytest.raises(ValueError):
        model_flops("baseline", TINY, 3, [2, 2], 3)
    with pytest.raises(ValueError):
        paper_ideal_speedup(TINY, 3, 2, 1, overhead=-1)
    with pytest.raises(ValueError):
        ModelShape(dim=4, n_layers=1, n_heads=3, n_kv_heads=2, head_dim=2, hidden_dim=8, vocab_size=10)


def test_attention_counter_counts_the_pairs_a_kernel_computes():
    q, k = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    for kwargs, pairs in (({"is_causal": True}, 21), ({"attn_mask": mask}, 36), ({}, 36)):
        counter = AttentionCounter()
        with counter:
            F.scaled_dot_product_attention(q.requires_grad_(), k, k, **kwargs).sum().backward()
        assert counter.flops == 3 * 4 * 2 * 4 * 8 * pairs and counter.calls == 1, kwargs
        q = q.detach()


CASES = [  # (family, overrides, P, response lengths, layout, microbatch)
    ("llama3", {}, 20, [5, 5, 5], "padded", 1),
    ("llama3", {"n_layers": 3}, 17, [5, 9, 3], "padded", 2),
    ("qwen3", {}, 13, [4, 7], "packed", None),
    ("qwen3", {}, 13, [4, 7], "packed", 1),  # a packed row of one response: its split suffix call is causal
    ("qwen3", {"n_layers": 1}, 9, [6, 2, 4, 3], "padded", None),
]


@pytest.mark.parametrize("family,extra,P,lens,layout,microbatch", CASES)
def test_model_matches_what_runs(family, extra, P, lens, layout, microbatch):
    """Modelled GEMM FLOPs within 2% of FlopCounterMode, attention FLOPs equal to the pairs each SDPA call
    computes, for every system (and both PrefixFlow attention variants) on several shapes."""
    from conftest import tiny_model

    import prefixflow as pf
    from harness.peers.prefix_grouper import train_group_prefix_grouper

    model = tiny_model(family, dtype=torch.float32, **extra)
    shape = as_shape(pf.model_args(model))
    group = pf.synthetic_group(97, P, lens, seed=0)
    runs = [
        ("baseline", "split"),
        ("prefixflow", "split"),
        ("prefixflow", "concat"),
        ("prefix_grouper", "split"),
    ]
    for system, attention in runs:
        pf.apply_prefixflow(model, pf.PrefixFlowConfig(attention=attention))
        if system == "prefix_grouper":
            counted, _ = count_flops(lambda: train_group_prefix_grouper(model, group))
        else:
            counted, _ = count_flops(
                lambda s=system: pf.train_group(model, group, system=s, layout=layout, microbatch=microbatch)
            )
        modelled = executed_flops(
            system, shape, P, lens, layout=layout, microbatch=microbatch, attention=attention
        )
        assert abs(modelled.gemm - counted.gemm) <= 0.02 * counted.gemm, (
            system,
            attention,
            modelled,
            counted,
        )
        assert modelled.attention == counted.attention, (system, attention, modelled, counted)


def _norm_params(model) -> int:
    import torch

    return sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.RMSNorm) for p in m.parameters())


def test_llama3_args_match_torchtitan_count():
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    args = TransformerModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=48, ffn_dim_multiplier=1.3
    )
    model = Transformer(args)
    shape = as_shape(args)
    assert shape.hidden_dim == model.layers["0"].feed_forward.w1.out_features
    assert shape.head_dim == 16 and shape.n_kv_heads == 2
    seq = 128
    _, tt = args.get_nparams_and_flops(model, seq)
    # TorchTitan counts norm weights as 6 FLOPs/token and ignores causal sparsity
    assert dense_flops_per_token(shape, seq) == tt - 6 * _norm_params(model)
    assert dense_flops_per_token(shape, seq, causal=True) < dense_flops_per_token(shape, seq)


def test_qwen3_args_match_torchtitan_count():
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
    from torchtitan.models.qwen3.model.model import Qwen3Model

    args = Qwen3ModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=96, vocab_size=256
    )
    model = Qwen3Model(args)
    shape = as_shape(args)
    assert (shape.head_dim, shape.hidden_dim) == (32, 96)
    seq = 64
    _, tt = args.get_nparams_and_flops(model, seq)
    assert dense_flops_per_token(shape, seq) == tt - 6 * _norm_params(model)
