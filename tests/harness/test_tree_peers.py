"""fp64: every tree peer (tree_mask, dfs_relay, prefixflow_flat) and PrefixFlow on trees match the
full-sequence baseline on the same paths (loss, and every gradient as max|d| / max|ref| per tensor, <= 1e-9),
on random trees and on every workload shape; each check has a negative control that must move it."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from support.reference import max_rel_diff
from support.tree_reference import random_tree

import prefixflow as pf
from harness.contenders import get_contender
from harness.peers import dfs_relay as relay_mod
from harness.peers import tree_mask as mask_mod
from harness.peers.dfs_relay import train_dfs_relay
from harness.peers.tree_flat import common_prefix_len, flatten_tree, rebuild_tree
from harness.peers.tree_mask import train_tree_mask
from harness.workloads import AgenticShape, FlatShape, SearchShape, SharedContextShape

TOL = 1e-9
GRPO = {"kl_coef": 0.05, "clip_eps_low": 0.1, "clip_eps_high": 0.15}
PEERS = {
    "tree_mask": lambda m, t, **kw: train_tree_mask(m, t, **kw),
    "tree_mask_mb2": lambda m, t, **kw: train_tree_mask(m, t, microbatch=2, **kw),
    "dfs_relay": lambda m, t, **kw: train_dfs_relay(m, t, **kw),
    "prefixflow_flat": lambda m, t, **kw: pf.train_group(
        m, flatten_tree(t), layout="packed", microbatch=2, **kw
    ),
    "prefixflow": lambda m, t, **kw: pf.train_group(m, t, layout="packed", microbatch=2, **kw),
    "prefixflow_auto": lambda m, t, **kw: pf.train_group(m, rebuild_tree(t, "auto"), microbatch=2, **kw),
}


def run(model, fn):
    model.zero_grad(set_to_none=True)
    stats = fn()
    return stats.loss, [p.grad.detach().clone() for p in model.parameters()]


def gap(model, tree, peer, loss="pg"):
    """(loss relative error, max over tensors of max|d|/max|ref|) of ``peer`` against the baseline."""
    kw = {"loss": loss, "loss_config": GRPO if loss == "grpo" else None}
    want_loss, want = run(model, lambda: pf.train_group(model, tree, system="baseline", **kw))
    got_loss, got = run(model, lambda: PEERS[peer](model, tree, **kw))
    return abs(got_loss - want_loss) / max(1.0, abs(want_loss)), max_rel_diff(got, want)


@pytest.mark.parametrize("peer", list(PEERS))
@pytest.mark.parametrize("depth,branching,loss", [(1, 4, "pg"), (2, 3, "grpo"), (3, 2, "pg"), (4, 2, "grpo")])
def test_peer_matches_baseline_on_random_trees(peer, depth, branching, loss):
    model = tiny_model("llama3")
    tree = random_tree(depth * 10 + branching, depth, branching, grpo=loss == "grpo")
    loss_gap, grad_gap = gap(model, tree, peer, loss)
    assert loss_gap <= TOL and grad_gap <= TOL, (peer, loss_gap, grad_gap)


SHAPES = [
    AgenticShape(system_len=12, turns=3, assistant_len=3, reply_len=4, branch=2, branch_at=[0, 2], seed=1),
    SearchShape(prompt_len=8, depth=3, branch=2, segment_len=3, seed=2),
    SharedContextShape(context_len=10, prompts=2, prompt_len=3, responses=3, response_len=4, seed=3),
    FlatShape(prompt_len=10, n=3, response_len=5, seed=4),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.kind)
def test_peers_match_baseline_on_workloads(shape):
    model = tiny_model("qwen3")
    tree = shape.generate(97).tree()
    for peer in PEERS:
        loss_gap, grad_gap = gap(model, tree, peer)
        assert loss_gap <= TOL and grad_gap <= TOL, (shape.kind, peer, loss_gap, grad_gap)


def test_negative_control_tree_mask_plain_causal(monkeypatch):
    """Packing without the tree mask (plain causal: a leaf sees its siblings) must move the gradients far
    past the tolerance."""
    model = tiny_model("llama3")
    tree = random_tree(32, 3, 2)
    real = mask_mod.pack_paths

    def broken(inp, paths):
        tokens, positions, mask, *rest = real(inp, paths)
        return (tokens, positions, torch.ones_like(mask).tril_(), *rest)

    monkeypatch.setattr(mask_mod, "pack_paths", broken)
    assert gap(model, tree, "tree_mask")[1] > 1e-3


def test_negative_control_dfs_relay_drops_descendant_kv_grads(monkeypatch):
    """A relay whose descendants' dK/dV never reach their ancestors must fail the exactness check."""
    model = tiny_model("llama3")
    tree = random_tree(32, 3, 2)
    monkeypatch.setattr(relay_mod._Relay, "deposit", lambda self, made: None)
    assert gap(model, tree, "dfs_relay")[1] > 1e-3


def test_negative_control_flat_tree_with_wrong_mask(monkeypatch):
    """A flattened tree whose paths lose a trained token (the shared one counted once) fails the check."""
    model = tiny_model("llama3")
    tree = random_tree(23, 2, 3)
    flat = flatten_tree(tree)
    masks = [m.clone() for m in flat.loss_masks]
    masks[1][masks[1].nonzero()[0]] = False
    broken = pf.RolloutTree(flat.segments, flat.parents, flat.path_ends, flat.advantages, masks)
    monkeypatch.setitem(PEERS, "prefixflow_flat", lambda m, t, **kw: pf.train_group(m, broken, **kw))
    assert gap(model, tree, "prefixflow_flat")[0] > 1e-6


def test_flat_tree_shares_only_the_common_prefix():
    tree = SearchShape(prompt_len=8, depth=2, branch=3, segment_len=3).generate(97).tree()
    flat = flatten_tree(tree)
    assert common_prefix_len(tree) == 8 == flat.node_len(0)
    assert flat.n == tree.n == 9 and max(len(flat.path_nodes(i)) for i in range(flat.n)) == 2
    assert [flat.path_tokens(i).tolist() for i in range(9)] == [
        tree.path_tokens(i).tolist() for i in range(9)
    ]
    assert flat.unique_tokens == 8 + 9 * 6 > tree.unique_tokens == 8 + 3 * 3 + 9 * 3


def test_peers_count_their_work():
    """tree_mask runs each node once per microbatch; dfs_relay forwards internal nodes twice."""
    model = tiny_model("llama3")
    tree = SearchShape(prompt_len=8, depth=2, branch=2, segment_len=3).generate(97).tree()
    internal = sum(tree.node_len(j) for j in range(tree.n_nodes) if tree.children[j])
    assert train_tree_mask(model, tree).trunk_tokens == tree.unique_tokens
    assert train_tree_mask(model, tree, microbatch=2).trunk_tokens == tree.unique_tokens + 8
    assert train_dfs_relay(model, tree).trunk_tokens == tree.unique_tokens + internal


def test_contenders_take_flat_groups_and_trees():
    model = tiny_model("llama3")
    group = pf.synthetic_group(97, 6, [3, 4], seed=0)

    class Cell:
        microbatch, loss, layout = None, "pg", "packed"

    want_loss, want = run(model, lambda: pf.train_group(model, group, system="baseline"))
    for name in ("tree_mask", "dfs_relay", "prefixflow_flat", "prefixflow_auto"):
        got_loss, got = run(model, lambda n=name: get_contender(n).step(model, [group], Cell, None))
        assert abs(got_loss - want_loss) <= TOL and max_rel_diff(got, want) <= TOL, name


if __name__ == "__main__":  # the worst gap per peer over both families (docs/trees-practice.md)
    worst = dict.fromkeys(PEERS, 0.0)
    cases = [(1, 4, "pg"), (2, 3, "grpo"), (3, 2, "pg"), (4, 2, "grpo")]
    for family in ("llama3", "qwen3"):
        model = tiny_model(family)
        trees = [(random_tree(d * 10 + b, d, b, grpo=loss == "grpo"), loss) for d, b, loss in cases]
        trees += [(shape.generate(97).tree(), "pg") for shape in SHAPES]
        for tree, loss in trees:
            for peer in PEERS:
                worst[peer] = max(worst[peer], *gap(model, tree, peer, loss))
    print({peer: f"{v:.1e}" for peer, v in worst.items()})
