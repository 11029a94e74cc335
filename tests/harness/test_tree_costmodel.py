"""harness.costmodel.tree_flops: a prefix tree's executed FLOPs against FlopCounterMode and the attention pairs
each SDPA call computes, for both systems, layouts and microbatchings; and the unique-token ideal."""

from __future__ import annotations

import pytest
import torch
from support.tree_reference import random_tree

import prefixflow as pf
from harness.costmodel.flops import as_shape, count_flops, executed_flops
from harness.costmodel.tree_flops import executed_tree_flops, ideal_tree_flops

CASES = [  # (family, overrides, tree seed, depth, branching, layout, microbatch)
    ("llama3", {}, 3, 3, 3, "padded", 1),
    ("llama3", {"n_layers": 3}, 7, 2, 4, "packed", 2),
    ("qwen3", {}, 11, 4, 2, "packed", None),
    ("qwen3", {"n_layers": 1}, 5, 3, 3, "padded", None),
    ("llama3", {}, 0, 0, 0, "packed", 2),  # seed 0: cached nodes that score nothing
    ("qwen3", {"n_layers": 3}, 0, 0, 0, "padded", None),
]


@pytest.mark.parametrize("family,extra,seed,depth,branching,layout,microbatch", CASES)
def test_tree_model_matches_what_runs(family, extra, seed, depth, branching, layout, microbatch):
    """Modelled GEMM FLOPs equal to FlopCounterMode's count, attention FLOPs to the pairs every SDPA call
    computes."""
    from conftest import tiny_model

    model = tiny_model(family, dtype=torch.float32, **extra)
    shape = as_shape(pf.model_args(model))
    tree = random_tree(seed, depth, branching) if seed else _unscored_nodes_tree()
    for system in ("baseline", "prefixflow"):
        counted, _ = count_flops(
            lambda s=system: pf.train_group(model, tree, system=s, layout=layout, microbatch=microbatch)
        )
        modelled = executed_tree_flops(system, shape, tree, layout=layout, microbatch=microbatch)
        assert modelled == counted, (system, modelled, counted)


def _unscored_nodes_tree():
    """Cached nodes that score no token (loss on each path's last two tokens only): their backward never
    reaches the last layer's attention, wq, wo or MLP."""
    gen = torch.Generator().manual_seed(0)
    seg = [torch.randint(0, 97, (n,), generator=gen) for n in (30, 20, 6, 5)]
    seqs = [
        torch.cat([seg[0], seg[1], seg[2]]),
        torch.cat([seg[0], seg[1], seg[3]]),
        torch.cat([seg[0], seg[3]]),
    ]
    return pf.build_tree(seqs, [1.0, -1.0, 0.5], [torch.arange(len(x)) >= len(x) - 2 for x in seqs])


def test_a_flat_tree_costs_what_the_flat_group_does_and_the_ideal_bounds_prefixflow():
    """The depth-1 tree of a flat group: the baseline's FLOPs are the flat model's; PrefixFlow on a tree runs
    the prefix's last layer whole (it scores the first response tokens there), so it costs a little more than
    the flat schedule, and no less than the ideal."""
    from conftest import tiny_model

    shape = as_shape(pf.model_args(tiny_model("llama3")))
    group = pf.synthetic_group(97, 16, [5, 7, 4], seed=1)
    tree = pf.build_tree([torch.cat([group.prompt, r]) for r in group.responses], group.advantages.tolist())
    for layout in ("padded", "packed"):
        flat = executed_flops("baseline", shape, 16, [5, 7, 4], layout=layout)
        assert executed_tree_flops("baseline", shape, tree, layout=layout) == flat
    ideal = ideal_tree_flops(shape, tree)
    packed = executed_tree_flops("prefixflow", shape, tree, layout="packed")
    assert ideal.total <= packed.total <= executed_tree_flops("baseline", shape, tree).total
