"""harness.costmodel.hybrid: a hybrid model's executed FLOPs (Qwen3.5 gated DeltaNet, Nemotron-H Mamba-2), op by op
against what runs: FlopCounterMode's mm/addmm (linear layers, LM head) and bmm (the chunked kernels), and the
counters for what FlopCounterMode cannot count right (causal SDPA pairs, grouped convolutions, triangular solves).
Both systems, padded and packed, microbatch 1, 2 and all, split and concat attention, prompts of 1 and 2 tokens,
one-token responses, and rows that cross the kernels' chunk boundaries (``scripts/hybrid_flops_check.py`` runs
every combination)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from packaging.version import Version

transformers = pytest.importorskip("transformers")

from support.hybrid import VOCAB, nemotron_h, qwen3_5  # noqa: E402

import prefixflow as pf  # noqa: E402
from harness.costmodel.counting import KernelCounter, count_flops, count_ops  # noqa: E402
from harness.costmodel.flops import as_shape, executed_flops, ideal_speedup, paper_ideal_speedup  # noqa: E402
from harness.costmodel.hybrid import GatedDeltaNet, HybridShape, hybrid_ops  # noqa: E402
from prefixflow.integrations import hf  # noqa: E402

# The cost model follows transformers' torch kernels for GDN and Mamba-2 op by op, as of the [hf] pin (5.24.0).
# transformers 5.17.0 (the lent GPU machine's) counts other recurrent FLOPs (e.g. 10,719,786 against 10,925,568
# in test_count_flops_splits_the_kinds), so the op-by-op equalities hold from 5.24 (docs/gpu.md).
COUNTS_HF_KERNELS = pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.24.0"),
    reason=f"transformers {transformers.__version__}: the cost model follows 5.24's recurrent kernels",
)

LIN, FULL = "linear_attention", "full_attention"
CASES = [  # (family, layer types, prompt length, response lengths)
    (qwen3_5, (LIN, FULL, LIN), 13, [5, 1, 7]),
    (qwen3_5, (FULL, LIN), 60, [5, 70, 1]),  # chunks of 64: baseline rows of 64/129/60, PrefixFlow 59 + 70
    (qwen3_5, (LIN, LIN), 2, [4, 1, 3]),  # one cached token; a one-token suffix is padded to two
    (nemotron_h, (LIN, FULL, "mlp"), 13, [5, 9, 1, 7]),  # Mamba-2 chunk 8
    (nemotron_h, ("mlp", LIN, FULL), 1, [3, 2]),  # no prefix to cache
]
RUNS = [  # (system, layout, microbatch, attention)
    ("baseline", "padded", None, "split"),
    ("baseline", "packed", 2, "split"),  # packed rows: the recurrent mixers run their segments as a batch
    ("prefixflow", "padded", None, "split"),
    ("prefixflow", "padded", 1, "concat"),
    ("prefixflow", "packed", 2, "split"),
    ("prefixflow", "packed", 1, "split"),  # a packed row of one response: its suffix call is causal
    ("prefixflow", "packed", None, "concat"),
]


@COUNTS_HF_KERNELS
@pytest.mark.parametrize("family,types,P,lens", CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_hybrid_model_matches_what_runs(family, types, P, lens):
    """Every op count of the model equals the counters' on every run (exact, not within a tolerance)."""
    model = family(types, dtype=torch.float32)
    shape = as_shape(model.config)
    group = pf.synthetic_group(VOCAB, P, lens, seed=3)
    for system, layout, mb, attention in RUNS:
        pf.apply_prefixflow(model, pf.PrefixFlowConfig(attention=attention))
        counted, _ = count_ops(
            lambda s=system, la=layout, m=mb: pf.train_group(model, group, system=s, layout=la, microbatch=m)
        )
        modelled = hybrid_ops(system, shape, P, lens, layout=layout, microbatch=mb, attention=attention)
        assert modelled == counted, (system, layout, mb, attention, modelled, counted)
        flops = executed_flops(system, shape, P, lens, layout=layout, microbatch=mb, attention=attention)
        assert flops.total == sum(counted.values())


def test_gdn_kernel_by_hand():
    """One GDN row: the chunked kernel pads to 64, so the prefix/suffix split changes how many chunks run."""
    gdn = GatedDeltaNet(key_heads=1, value_heads=2, dk=4, dv=8, kernel=4)  # conv 2*4 + 16 = 24 channels
    C = 64
    mm_s, mm_q, mm_a = 2 * C * 4 * 8, 2 * C * C * 4, 2 * C * C * 8
    # 65 tokens from the zero state, output used, end state unused: 2 chunks
    fwd = 2 * (2 * mm_q + 3 * mm_s + mm_a)
    bwd = 2 * 2 * mm_q + 3 * mm_s + 2 * 1 * mm_s + 2 * 2 * mm_q + 3 * mm_s + 2 * 2 * mm_a + 2 * 2 * C * C * 12
    ops = gdn.kernel_ops(1, 65, initial=False, output=True, final=False)
    assert ops["bmm"] == 2 * (fwd + bwd)
    assert ops["solve"] == 2 * 2 * 2 * C * (C - 1) * 12  # 2 heads x (forward + backward) x 2 chunks
    assert ops["conv"] == 3 * 2 * 24 * 4 * (65 + 3)
    one = gdn.kernel_ops(1, 64, initial=False, output=True, final=False)["bmm"]
    assert ops["bmm"] > 1.9 * one  # token 65 opens a whole second chunk
    # from a cached state the convolution also reads the 3-token tail; the first chunk's q·S and k·S take a
    # state gradient
    cached = gdn.kernel_ops(1, 10, initial=True, output=True, final=False)
    zero = gdn.kernel_ops(1, 10, initial=False, output=True, final=False)
    assert cached["bmm"] - zero["bmm"] == 2 * 2 * mm_s
    assert cached["conv"] - zero["conv"] == 3 * 2 * 24 * 4 * 3


def test_prefix_split_changes_the_chunk_count():
    """P = 60, S = 10: the baseline's 69-token rows run 2 chunks of 64; PrefixFlow's 59-token prefix and
    10-token suffixes run 1 each."""
    shape = as_shape(hf.hf_config("qwen3_5-tiny"))
    base = hybrid_ops("baseline", shape, 60, [10, 10], microbatch=1)
    short = hybrid_ops("baseline", shape, 55, [10, 10], microbatch=1)  # 64-token rows: 1 chunk
    assert base["bmm"] > 1.9 * short["bmm"]
    pf_long = hybrid_ops("prefixflow", shape, 60, [10, 10], microbatch=1)
    assert pf_long["bmm"] == hybrid_ops("prefixflow", shape, 55, [10, 10], microbatch=1)["bmm"]


def test_flop_counter_miscounts_grouped_convs_and_misses_solves():
    """Why the convolutions and solves have counters of their own: FlopCounterMode counts a depthwise
    convolution's weight gradient C times too high and does not see linalg_solve_triangular."""
    from torch.utils.flop_counter import FlopCounterMode

    C, K, L = 6, 4, 10
    x = torch.randn(2, C, L, requires_grad=True)
    w = torch.randn(C, 1, K, requires_grad=True)
    fcm, mine = FlopCounterMode(display=False), KernelCounter()
    with fcm, mine:
        F.conv1d(x, w, padding=K - 1, groups=C)[..., :L].sum().backward()
    per_op = {op.__name__: v for op, v in fcm.get_flop_counts()["Global"].items()}
    one = 2 * 2 * C * K * (L + K - 1)
    assert per_op["convolution"] == one and mine.conv == 3 * one
    assert per_op["convolution_backward"] == one + C * one  # grad input right, grad weight C times too high
    a = torch.randn(3, 5, 5).tril(-1) + torch.eye(5)
    fcm, mine = FlopCounterMode(display=False), KernelCounter()
    with fcm, mine:
        torch.linalg.solve_triangular(a, torch.randn(3, 5, 2), upper=False, unitriangular=True)
    assert not fcm.get_flop_counts().get("Global") and mine.solve == 3 * 2 * 5 * 4


def test_shapes_and_refusals():
    """Qwen3.5 and Nemotron-H configs get a HybridShape; other hybrids, PrefixGrouper and trees are refused."""
    for name in ("qwen3_5-tiny", "nemotron_h-tiny"):
        shape = as_shape(hf.hf_config(name))
        assert isinstance(shape, HybridShape) and shape.n_layers == 3
        assert ideal_speedup(shape, 320, 64, 16) > 1 and paper_ideal_speedup(shape, 320, 64, 16) > 1
        with pytest.raises(ValueError, match="covers systems"):
            executed_flops("prefix_grouper", shape, 12, 4, 3)
    from transformers import BambaConfig

    with pytest.raises(ValueError, match="model_type 'bamba'"):
        as_shape(BambaConfig(num_hidden_layers=2, attn_layer_indices=[1]))
    from harness.costmodel.tree_flops import executed_tree_flops

    with pytest.raises(ValueError, match="dense decoders only"):
        executed_tree_flops("baseline", as_shape(hf.hf_config("qwen3_5-tiny")), None)


@COUNTS_HF_KERNELS
def test_count_flops_splits_the_kinds():
    """count_flops' kinds: linear layers (gemm), SDPA pairs (attention), the mixers' kernels (recurrent).
    (pf-bench's records carry both, equal: tests/prefixflow/hybrid/test_hybrid_refusals.py.)"""
    model = qwen3_5((LIN, FULL), dtype=torch.float32)
    group = pf.synthetic_group(VOCAB, 5, [3, 2], seed=0)
    pf.apply_prefixflow(model)
    counted, _ = count_flops(lambda: pf.train_group(model, group))
    assert counted == executed_flops("prefixflow", as_shape(model.config), 5, [3, 2])
    assert min(counted.gemm, counted.attention, counted.recurrent) > 0
