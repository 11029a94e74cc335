"""fp64: prefix trees through the one driver match the full-sequence baseline on the same paths and an
independent per-path reference to <= 1e-9 (loss, and every gradient as max|d| / max|ref| per tensor)."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import tiny_model
from support.reference import max_rel_diff, reference_pg
from support.tree_reference import depth_of, random_tree, reference_tree

import prefixflow as pf
from prefixflow.memory.budget import OverBudgetWarning
from prefixflow.tree.plan import TreeRows

TOL = 1e-9
GRPO = {"kl_coef": 0.05, "clip_eps_low": 0.1, "clip_eps_high": 0.15}


def grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def train(model, tree, **kwargs):
    model.zero_grad(set_to_none=True)
    stats = pf.train_group(model, tree, **kwargs)
    return stats.loss, grads(model), stats


def assert_close(got_loss, got, want_loss, want, what):
    assert abs(got_loss - want_loss) <= TOL * max(1.0, abs(want_loss)), (what, got_loss, want_loss)
    rel = max_rel_diff(got, want)
    assert rel <= TOL, (what, rel)


@pytest.mark.parametrize("depth,branching", [(1, 4), (2, 3), (3, 2), (4, 2), (2, 5), (3, 1)])
def test_random_trees_match_reference_and_baseline(family, depth, branching):
    model = tiny_model(family)
    tree = random_tree(depth * 10 + branching, depth, branching)
    assert depth_of(tree) >= min(depth, 2) - (branching == 1)  # a chain (branching 1) collapses to one node
    want_loss, want = reference_tree(model, tree)
    for layout in ("padded", "packed"):
        for system in ("baseline", "prefixflow"):
            for microbatch in (None, 1, 2, 3):
                loss, got, _ = train(model, tree, system=system, layout=layout, microbatch=microbatch)
                assert_close(loss, got, want_loss, want, (system, layout, microbatch))


@pytest.mark.parametrize("ac", ["selective", "full"])
def test_activation_checkpointing(family, ac):
    model = tiny_model(family, ac=ac)
    tree = random_tree(7, 3, 3)
    want_loss, want = reference_tree(model, tree)
    for layout in ("padded", "packed"):
        for microbatch in (None, 2):
            loss, got, _ = train(model, tree, layout=layout, microbatch=microbatch)
            assert_close(loss, got, want_loss, want, (ac, layout, microbatch))


@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
def test_grpo_with_old_and_ref_logprobs_and_kl(family, importance_sampling):
    model = tiny_model(family)
    tree = random_tree(11, 3, 3, grpo=True)
    cfg = {**GRPO, "importance_sampling": importance_sampling}
    want_loss, want = reference_tree(model, tree, "grpo", cfg)
    for layout in ("padded", "packed"):
        for system in ("baseline", "prefixflow"):
            for microbatch in (None, 1, 3):
                loss, got, _ = train(
                    model, tree, system=system, layout=layout, microbatch=microbatch, loss="grpo",
                    loss_config=cfg,
                )  # fmt: skip
                assert_close(loss, got, want_loss, want, (system, layout, microbatch))


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum"])
def test_other_aggregations_match_the_baseline(aggregation):
    model = tiny_model("llama3")
    tree = random_tree(5, 2, 4, grpo=True)
    cfg = {**GRPO, "aggregation": aggregation}
    want_loss, want, _ = train(model, tree, system="baseline", loss="grpo", loss_config=cfg)
    for layout in ("padded", "packed"):
        loss, got, _ = train(model, tree, layout=layout, microbatch=2, loss="grpo", loss_config=cfg)
        assert_close(loss, got, want_loss, want, (aggregation, layout))


def hand_tree():
    """A root, a chain node (one child, no loss), a branch point inside a turn, loss tokens in shared nodes,
    two duplicate paths with different masks, and a path ending at an internal node."""
    seg = [torch.tensor(t) for t in ([5, 6, 7, 8], [9, 10], [11, 12, 13], [14, 15], [16], [17, 18, 19])]
    parents = [-1, 0, 1, 2, 2, 0]  # node 1 is a chain: one child, no loss
    ends = [3, 3, 4, 5, 2]
    lens = [11, 11, 10, 7, 9]
    masks = [torch.zeros(n, dtype=torch.bool) for n in lens]
    masks[0][[6, 7, 8, 9, 10]] = True  # node 2 (shared by paths 0-2, 4) and node 3
    masks[1][[6, 10]] = True  # path 1 duplicates path 0's tokens, trains fewer
    masks[2][[7, 9]] = True  # node 4's single token: scored by node 2's last row
    masks[3][[3, 4, 6]] = True  # a root token, node 5's first (scored by the root) and last token
    masks[4][[6, 7, 8]] = True  # ends at internal node 2: every token scored in Phase A
    return pf.RolloutTree(seg, parents, ends, torch.tensor([1.0, -0.5, 0.7, -1.2, 0.4]), masks)


def test_hand_tree_chain_duplicates_and_internal_ends(family):
    model = tiny_model(family)
    tree = hand_tree()
    want_loss, want = reference_tree(model, tree)
    for layout in ("padded", "packed"):
        for microbatch in (None, 1, 2):
            loss, got, stats = train(model, tree, layout=layout, microbatch=microbatch)
            assert_close(loss, got, want_loss, want, (layout, microbatch))
            assert stats.prefix_tokens == 4 + 2 + 3  # the cached nodes 0, 1, 2, each once
    loss, got, _ = train(model, tree, system="baseline")
    assert_close(loss, got, want_loss, want, "baseline")


def test_packed_trunk_runs_the_unique_tokens():
    """Packed with every path in one microbatch: the trunk runs each node once, duplicates once per path."""
    model = tiny_model("llama3")
    tree = random_tree(3, 3, 3)
    _, _, stats = train(model, tree, layout="packed")
    assert stats.trunk_tokens <= tree.unique_tokens + sum(
        tree.node_len(tree.path_ends[i]) for i in range(tree.n)
    )
    distinct_leaves = {tree.path_ends[i] for i in range(tree.n)}
    if len(distinct_leaves) == tree.n:
        assert stats.trunk_tokens <= tree.unique_tokens
    cached = TreeRows(tree).cached
    assert stats.tree["unique_tokens"] == tree.unique_tokens and stats.tree["cached_nodes"] == len(cached)
    assert sorted(stats.tree["node_times"]) == sorted(cached)  # each cached node's forward and backward
    assert all(t["A"] > 0 and t["C"] > 0 for t in stats.tree["node_times"].values())


def test_flat_group_as_tree_matches_the_flat_schedule(family):
    model = tiny_model(family)
    group = pf.synthetic_group(97, 9, [3, 1, 6, 4], seed=2, with_logprobs=True)
    for loss, cfg in (("pg", None), ("grpo", GRPO)):
        for layout in ("padded", "packed"):
            flat_loss, flat, _ = train(model, group, layout=layout, microbatch=2, loss=loss, loss_config=cfg)
            tree_loss, tree, _ = train(
                model, group.as_tree(), layout=layout, microbatch=2, loss=loss, loss_config=cfg
            )
            assert_close(tree_loss, tree, flat_loss, flat, (loss, layout))


def test_group_loss_masks_train_as_tree(family):
    model = tiny_model(family)
    group = pf.synthetic_group(97, 6, [5, 4, 3], seed=4)
    masks = [torch.tensor(m, dtype=torch.bool) for m in ([1, 0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 1])]
    masked = pf.RolloutGroup(group.prompt, group.responses, group.advantages, loss_masks=masks)
    want_loss, want = reference_tree(model, masked.as_tree())
    for system in ("baseline", "prefixflow"):
        loss, got, _ = train(model, masked, system=system, microbatch=2)
        assert_close(loss, got, want_loss, want, system)
    all_true = [torch.ones(n, dtype=torch.bool) for n in group.response_lens]
    full = pf.RolloutGroup(group.prompt, group.responses, group.advantages, loss_masks=all_true)
    ref_loss, ref = reference_pg(model, group)
    loss, got, _ = train(model, full)
    assert_close(loss, got, ref_loss, ref, "all-true masks = the unmasked group")


def test_forest_trains_every_tree_in_one_call(family):
    model = tiny_model(family)
    seqs = [torch.tensor(s) for s in ([1, 2, 3, 4], [1, 2, 5], [7, 8, 9], [7, 8, 9, 10, 11], [20, 21])]
    tree = pf.build_tree(seqs, [0.5, -1.0, 0.3, 0.9, -0.2], [torch.arange(len(s)) >= 1 for s in seqs])
    assert sum(p < 0 for p in tree.parents) == 3
    want_loss, want = reference_tree(model, tree)
    for layout in ("padded", "packed"):
        loss, got, _ = train(model, tree, layout=layout, microbatch=2)
        assert_close(loss, got, want_loss, want, layout)


def test_min_shared_tokens_merges_short_nodes_and_stays_exact():
    model = tiny_model("qwen3")
    fine, coarse = random_tree(13, 3, 3), random_tree(13, 3, 3, min_shared_tokens=3)
    assert coarse.n_nodes < fine.n_nodes
    want_loss, want = reference_tree(model, fine)
    for layout in ("padded", "packed"):
        loss, got, _ = train(model, coarse, layout=layout, microbatch=2)
        assert_close(loss, got, want_loss, want, layout)


@pytest.mark.parametrize("system", ["prefixflow", "baseline"])
def test_microbatch_auto_sizes_the_paths_to_the_budget_and_stays_exact(system):
    tree = random_tree(5, 3, 4)
    model = tiny_model("llama3")
    want_loss, want = reference_tree(model, tree)
    sizes = {}
    for budget in (1, 2**40):  # below one path (one at a time, warned), and everything after the probes
        pf.apply_prefixflow(model, pf.PrefixFlowConfig(memory_budget_bytes=budget))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OverBudgetWarning)
            loss, got, stats = train(model, tree, system=system, layout="packed", microbatch="auto")
        assert_close(loss, got, want_loss, want, (system, budget))
        sizes[budget] = stats.plan["microbatch_sizes"]
    n_rows = tree.n if system == "baseline" else tree.n - len(TreeRows(tree).leafless)
    assert sum(sizes[1]) == sum(sizes[2**40]) == n_rows
    assert set(sizes[1]) == {1} and sizes[2**40] == (1, 1, n_rows - 2)


@pytest.mark.parametrize("ac", ["none", "full"])
def test_offload_of_dormant_node_activations_is_bitwise_exact_and_released(ac):
    gen = torch.Generator().manual_seed(4)
    seg = [torch.randint(0, 97, (n,), generator=gen) for n in (24, 16, 12, 9, 7, 11)]
    # a root of 24 tokens, two children (16, 12), the first with two children of its own: nodes long
    # enough that their saved tensors pass the offload's 4 KiB floor
    seqs = [
        torch.cat([seg[0], seg[1], seg[3]]),
        torch.cat([seg[0], seg[1], seg[4]]),
        torch.cat([seg[0], seg[2], seg[5]]),
    ]
    masks = [torch.arange(len(x)) >= 20 for x in seqs]
    tree = pf.build_tree(seqs, [1.0, -0.5, 0.7], masks)
    base = tiny_model("llama3", ac=ac)
    want_loss, want, base_stats = train(base, tree, layout="packed", microbatch=2)
    for prefetch in (True, False):
        model = tiny_model("llama3", ac=ac)
        pf.apply_prefixflow(model, pf.PrefixFlowConfig(offload=True, offload_prefetch=prefetch))
        loss, got, stats = train(model, tree, layout="packed", microbatch=2)
        assert loss == want_loss and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        off = stats.offload
        assert base_stats.offload is None and off.released and off.offloaded_bytes > 0
        # every offloaded byte came back once, except what autograd freed unneeded
        assert off.loaded_bytes == off.offloaded_bytes - off.dropped_bytes > 0
        assert (off.prefetched_bytes > 0) == prefetch


def test_depth_first_waves_bound_live_prefix_state_by_the_depth():
    """A full ternary tree (1 + 3 + 9 cached nodes, 27 leaves): with one path per microbatch only a
    root-to-parent chain is live at once (3 nodes); with every path in one microbatch, all 13. Both exact."""
    gen = torch.Generator().manual_seed(2)
    fresh = iter(torch.randperm(97, generator=gen).tolist())  # 87 distinct tokens: no accidental sharing

    def seg(n):
        return torch.tensor([next(fresh) for _ in range(n)])

    root = seg(6)
    seqs = []
    for _ in range(3):
        child = torch.cat([root, seg(3)])
        for _ in range(3):
            grandchild = torch.cat([child, seg(2)])
            seqs += [torch.cat([grandchild, seg(2)]) for _ in range(3)]
    tree = pf.build_tree(seqs, torch.randn(len(seqs), generator=gen, dtype=torch.float64))
    model = tiny_model("llama3")
    want_loss, want = reference_tree(model, tree)
    peaks = {}
    for microbatch in (1, 3, None):
        loss, got, stats = train(model, tree, layout="packed", microbatch=microbatch)
        assert_close(loss, got, want_loss, want, microbatch)
        peaks[microbatch] = (stats.tree["peak_live_nodes"], stats.tree["peak_cache_bytes"])
        assert stats.n_microbatches == -(-27 // (microbatch or 27))
    assert peaks[1][0] == peaks[3][0] == 3 and peaks[None][0] == 13
    assert peaks[1][1] < peaks[None][1]  # (the live chain also holds its gK/gV accumulators by then)
