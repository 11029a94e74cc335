"""harness.costmodel: FLOP counts by hand, the speedup model's limits, and TorchTitan's own count."""

from __future__ import annotations

import pytest

from harness.costmodel import (
    ModelShape,
    as_shape,
    dense_flops_per_token,
    flops_breakdown,
    ideal_speedup,
    model_flops,
    record_costs,
    speedup_terms,
)

TINY = ModelShape(dim=4, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=2, hidden_dim=8, vocab_size=10)
LLAMA8B = ModelShape(
    dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, hidden_dim=14336, vocab_size=128256
)


def test_tiny_shape_by_hand():
    # per token: q 4*2*2=16, o 16, k 4*1*2=8, v 8, mlp 3*4*8=96 -> 144 MACs; pair: 2*2*2=8; head: 40
    assert TINY.linear_macs_per_token == 144
    assert TINY.pair_macs == 8
    assert TINY.head_macs == 40
    P, S, N = 3, 2, 2
    # baseline: L = 4 tokens, 10 causal pairs, head at 2 positions, x N=2, x6 (fwd 2x MACs, bwd 2x fwd)
    base = 2 * 6 * (4 * 144 + 10 * 8 + 2 * 40)
    assert model_flops("baseline", TINY, P, S, N) == base == 8832
    # prefix: 2 tokens, 3 pairs; suffix: 2 tokens, 2*2 cross + 3 own pairs, head at 2; accum 2*1*2*1*2 = 8
    prefix = 6 * (2 * 144 + 3 * 8)
    suffix = 6 * (2 * 144 + 7 * 8 + 2 * 40)
    assert flops_breakdown(TINY, P, S) == {"prefix": prefix, "suffix": suffix, "accum": 8}
    assert model_flops("prefixflow", TINY, P, S, N) == prefix + 2 * (suffix + 8)
    assert model_flops("prefix_grouper", TINY, P, S, N) == prefix + 2 * suffix
    # the split at the KV boundary conserves work: baseline = N * (prefix + suffix)
    assert base == N * (prefix + suffix)


def test_split_conserves_work_for_many_lengths():
    for P, S in [(1, 1), (2, 7), (17, 5), (1000, 24)]:
        b = flops_breakdown(LLAMA8B, P, S)
        assert model_flops("baseline", LLAMA8B, P, S, 3) == 3 * (b["prefix"] + b["suffix"])


def test_speedup_at_n1_is_one_up_to_accumulation():
    for P, S in [(512, 512), (10240, 2048), (2, 100)]:
        s1 = ideal_speedup(LLAMA8B, P, S, 1)
        assert s1 <= 1.0
        assert s1 == pytest.approx(1.0, abs=1e-4)
    assert ideal_speedup(LLAMA8B, 512, 512, 1, overhead=0.5) == pytest.approx(1 / 1.5, rel=1e-4)


def test_speedup_approaches_inverse_suffix_share():
    P, S = 10240, 2048
    t = speedup_terms(LLAMA8B, P, S)
    assert t["p"] + t["s"] == pytest.approx(1.0)
    limit = 1 / (t["s"] + t["a"])
    assert ideal_speedup(LLAMA8B, P, S, 10**7) == pytest.approx(limit, rel=1e-5)
    # for a large model the FLOP share is close to the token share: bound ~ 1/(1-r)
    r = P / (P + S)
    assert 0.75 * (1 / (1 - r)) < limit < 1 / (1 - r)
    # the suffix also attends over the prefix, so its FLOP share exceeds its token share
    assert t["s"] > 1 - r
    # the paper's eager 10k/2k point is 3.800x at N=16, below the model's ideal there
    assert ideal_speedup(LLAMA8B, P, S, 16) > 3.8


def test_speedup_is_monotone_in_n_and_prefix_ratio():
    total = 1536
    prev_ratio = 0.0
    for P in (256, 512, 768, 1024, 1280):
        S = total - P
        values = [ideal_speedup(LLAMA8B, P, S, n) for n in (1, 2, 4, 8, 16, 32)]
        assert all(b > a for a, b in zip(values, values[1:], strict=False))
        assert values[-1] > prev_ratio
        prev_ratio = values[-1]
    # overhead lowers the speedup and its effect vanishes with N
    base16 = ideal_speedup(LLAMA8B, 1024, 512, 16)
    assert ideal_speedup(LLAMA8B, 1024, 512, 16, overhead=0.2) < base16
    gap = [ideal_speedup(LLAMA8B, 1024, 512, n) - ideal_speedup(LLAMA8B, 1024, 512, n, 0.2) for n in (4, 64)]
    assert gap[1] < gap[0]


def test_bad_inputs():
    with pytest.raises(ValueError):
        model_flops("nope", TINY, 3, 2, 1)
    with pytest.raises(ValueError):
        model_flops("baseline", TINY, 0, 2, 1)
    with pytest.raises(ValueError):
        ideal_speedup(TINY, 3, 2, 1, overhead=-1)
    with pytest.raises(ValueError):
        ModelShape(dim=4, n_layers=1, n_heads=3, n_kv_heads=2, head_dim=2, hidden_dim=8, vocab_size=10)


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


def test_record_costs_columns():
    rec = record_costs("baseline", TINY, 3, 2, 2)
    assert rec["model_flops"] == 8832.0
    assert rec["ideal_speedup"] == pytest.approx(8832 / model_flops("prefixflow", TINY, 3, 2, 2))
