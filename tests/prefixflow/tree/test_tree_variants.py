"""Prefix trees run what flat groups run, because they are the same path: both attention variants (split reads
each node's cache in place, under a mask over the cached keys when a microbatch's rows read different
ancestors) and compiled blocks, each exact in fp64 against the per-path reference (one process)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from packaging.version import Version
from support.reference import max_rel_diff
from support.tree_reference import random_tree, reference_tree

import prefixflow as pf
from prefixflow.attention.modes import NodeAttention

BOUND = 1e-12


def error_of(model, tree, **kwargs) -> float:
    """max(loss error, worst gradient error) of PrefixFlow on ``tree`` against the per-path reference."""
    want_loss, want = reference_tree(model, tree)
    model.zero_grad(set_to_none=True)
    stats = pf.train_group(model, tree, **kwargs)
    got = [p.grad for p in model.parameters()]
    return max(abs(stats.loss - want_loss) / abs(want_loss), max_rel_diff(got, want))


@pytest.mark.parametrize("attention", ["split", "concat"])
@pytest.mark.parametrize(
    "family,seed,layout,microbatch",
    [("llama3", 21, "padded", 2), ("qwen3", 5, "packed", None), ("llama3", 9, "packed", 1)],
)
def test_both_attention_variants_are_exact_on_trees(attention, family, seed, layout, microbatch):
    model = tiny_model(family)
    pf.apply_prefixflow(model, pf.PrefixFlowConfig(attention=attention))
    assert error_of(model, random_tree(seed, 3, 3), layout=layout, microbatch=microbatch) <= BOUND


@pytest.mark.parametrize("attention", ["split", "concat"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_a_forest_mixes_rows_with_and_without_cached_ancestors(attention, layout):
    """One microbatch holds a lone root's leaf row (it reads no cached node) beside the leaf rows of two
    shared roots' children: split attention's prefix part is empty for the first."""
    gen = torch.Generator().manual_seed(3)

    def seq(*lens):
        return [torch.randint(1, 97, (n,), generator=gen) for n in lens]

    lone, (a, a1, a2), (b, b1, b2, b3) = seq(20), seq(17, 4, 6), seq(15, 3, 5, 2)
    seqs = [
        lone[0],
        torch.cat([a, a1]),
        torch.cat([a, a2]),
        torch.cat([b, b1]),
        torch.cat([b, b2]),
        torch.cat([b, b3]),
    ]
    masks = [torch.arange(len(x)) >= 3 for x in seqs]  # loss in the shared roots too
    tree = pf.build_tree(seqs, torch.linspace(-1, 1, len(seqs)), masks)
    assert sum(p < 0 for p in tree.parents) == 3  # a forest of three roots
    model = tiny_model("llama3")
    pf.apply_prefixflow(model, pf.PrefixFlowConfig(attention=attention))
    assert error_of(model, tree, layout=layout, microbatch=None) <= BOUND


def test_split_reads_each_rows_own_ancestors(monkeypatch):
    """Negative control: split attention ignores the mask over the cached keys, so every row of a microbatch
    reads every cached node it holds, its siblings' branches included."""
    honest = NodeAttention.__init__

    def every_key_visible(self, *args, **kwargs):
        honest(self, *args, **{**kwargs, "keys_visible": True})

    model = tiny_model("llama3")
    pf.apply_prefixflow(model, pf.PrefixFlowConfig(attention="split"))
    tree = random_tree(21, 3, 3)
    assert error_of(model, tree, layout="packed") <= BOUND
    monkeypatch.setattr(NodeAttention, "__init__", every_key_visible)
    assert error_of(model, tree, layout="packed") > 1e-3


@pytest.mark.parametrize("attention", ["split", "concat"])
def test_compiled_blocks_are_exact_on_trees(attention):
    """``apply_compile`` (AOT-autograd graphs, eager kernels: the graph capture is what is tested; the
    inductor build of the same graphs is the flat group's slow test) on a tree: exact, and no graph break."""
    if attention == "split" and Version(torch.__version__).release < (2, 13):
        pytest.skip(f"torch {torch.__version__}: compiled split attention's gradients differ from eager "
                    "(0.64 on 2.11.0; exact on 2.13.0), docs/gpu.md")  # fmt: skip
    counters = torch._dynamo.utils.counters
    torch._dynamo.reset()
    model = tiny_model("llama3")
    pf.apply_prefixflow(model, pf.PrefixFlowConfig(attention=attention))
    pf.apply_compile(model, backend="aot_eager", dynamic=True)
    tree = random_tree(21, 3, 3)
    assert error_of(model, tree, layout="packed", microbatch=2) <= BOUND
    assert error_of(model, tree, layout="padded", microbatch=None) <= BOUND
    assert counters["graph_break"] == {}
