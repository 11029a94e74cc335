"""Prefix trees on Qwen3-MoE (fp64): routing replay from one recorded mask per node, the logical token
accounting of the load counters and the auxiliary balance loss, both systems equal."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.moe import one_thread, tiny_moe  # noqa: F401  (one_thread: a module-scoped fixture)
from support.reference import max_rel_diff
from support.tree_reference import random_tree

import prefixflow as pf
from prefixflow.moe import MoEConfig, moe_hooks_of, record_routing, tokens_per_expert

TOL = 1e-9


def _train(model, tree, **kwargs):
    model.zero_grad(set_to_none=True)
    for layer in pf.moe.moe_layers(model):
        layer.tokens_per_expert.zero_()
    stats = pf.train_group(model, tree, **kwargs)
    return stats.loss, [p.grad.clone() for p in model.parameters()], tokens_per_expert(model)


def _random_routing(tree, n_layers=2, experts=8, k=2, seed=0):
    """Masks unrelated to the trainer's router (an inference engine routes differently from training)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.stack(
            [torch.randperm(experts, generator=gen)[:k] for _ in range(n_layers * tree.node_len(j))]
        ).view(n_layers, tree.node_len(j), k)
        for j in range(tree.n_nodes)
    ]


@pytest.mark.parametrize("routing", ["recorded", "foreign", "live"])
@pytest.mark.parametrize("ac", ["none", "full"])
def test_tree_moe_prefixflow_equals_the_baseline(routing, ac):
    coef = 0.01 if routing != "live" else 0.0  # the balance loss needs recorded routing
    model = tiny_moe(ac=ac, config=MoEConfig(aux_loss_coef=coef))
    tree = random_tree(9, 3, 3)
    if routing == "recorded":
        tree = dataclasses.replace(tree, routing=record_routing(model, tree))
    elif routing == "foreign":
        tree = dataclasses.replace(tree, routing=_random_routing(tree))
    want_loss, want, want_counts = _train(model, tree, system="baseline", layout="packed", microbatch=2)
    want_aux = moe_hooks_of(model).aux_loss
    for layout, microbatch in (("packed", 1), ("padded", None), ("padded", 3)):
        loss, got, counts = _train(model, tree, layout=layout, microbatch=microbatch)
        assert abs(loss - want_loss) <= TOL * abs(want_loss), (layout, microbatch)
        assert max_rel_diff(got, want) <= TOL, (layout, microbatch)
        assert torch.equal(counts, want_counts), (layout, microbatch)  # every token once per path feeding it
        assert moe_hooks_of(model).aux_loss == pytest.approx(want_aux, rel=1e-12, abs=1e-15)
    if coef:
        assert want_aux > 0


def test_recorded_routing_is_what_the_router_chooses_live():
    model = tiny_moe()
    tree = random_tree(4, 2, 3)
    live = _train(model, tree, system="baseline", layout="padded")
    recorded = _train(
        model,
        dataclasses.replace(tree, routing=record_routing(model, tree)),
        system="baseline",
        layout="padded",
    )
    assert max_rel_diff(recorded[1], live[1]) <= TOL and torch.equal(recorded[2], live[2])


def test_a_tree_routing_that_does_not_fit_is_refused_before_any_gradient_changes():
    model = tiny_moe()
    tree = random_tree(4, 2, 3)
    masks = record_routing(model, tree)
    with pytest.raises(ValueError, match=r"routing\[1\] has shape"):
        dataclasses.replace(tree, routing=[masks[0], masks[1][:, :-1], *masks[2:]])
    bad = dataclasses.replace(tree, routing=masks)
    bad.routing = [m + 8 for m in masks]  # set after construction: the hook checks it again
    with pytest.raises(
        ValueError, match=r"routing\[0\] has expert id .* outside the model's experts \[0, 8\)"
    ):
        pf.train_group(model, bad)
    assert all(p.grad is None for p in model.parameters())
    dense = pf.apply_prefixflow(
        pf.build_model(
            "qwen3:debugmodel",
            dtype=torch.float64,
            overrides={
                "dim": 64,
                "n_layers": 2,
                "n_heads": 4,
                "n_kv_heads": 2,
                "head_dim": 16,
                "vocab_size": 97,
            },
        )
    )
    with pytest.raises(
        ValueError, match="tree.routing replays MoE expert choices, but this model has no MoE"
    ):
        pf.train_group(dense, dataclasses.replace(tree, routing=masks))
