"""Prefix-tree data: ``build_tree`` as a trie, ``RolloutTree`` validation, ``RolloutGroup.loss_masks`` and
``as_tree``, and the one-line errors ``train_group`` raises for bad trees before any gradient changes."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import prefixflow as pf


def t(*xs):
    return torch.tensor(xs)


def segments(tree):
    return [s.tolist() for s in tree.segments]


def test_trie_shares_prefixes_and_branches_inside_a_turn():
    seqs = [t(1, 2, 3, 4, 5), t(1, 2, 3, 9), t(1, 2, 7)]
    tree = pf.build_tree(seqs, [1.0, 0.0, -1.0])
    assert segments(tree) == [[1, 2], [3], [4, 5], [9], [7]]
    assert tree.parents == [-1, 0, 1, 1, 0]
    assert tree.path_ends == [2, 3, 4]
    for i, s in enumerate(seqs):
        assert torch.equal(tree.path_tokens(i), s)
    # loss_masks=None: every token after the longest common prefix [1, 2]
    assert [m.tolist() for m in tree.loss_masks] == [
        [False, False, True, True, True],
        [False, False, True, True],
        [False, False, True],
    ]


def test_duplicates_and_a_prefix_of_another_end_at_shared_nodes():
    seqs = [t(1, 2, 3, 4), t(1, 2, 3, 4), t(1, 2), t(1, 2, 3, 4, 6)]
    masks = [torch.arange(len(s)) >= 1 for s in seqs]
    tree = pf.build_tree(seqs, [1, 2, 3, 4], masks)
    assert segments(tree) == [[1, 2], [3, 4], [6]]
    assert tree.path_ends == [1, 1, 0, 2]
    assert tree.advantages.dtype == torch.float64


def test_forest_and_min_shared_tokens():
    seqs = [t(1, 2, 3), t(1, 4, 5), t(8, 9)]
    masks = [torch.arange(len(s)) >= 1 for s in seqs]
    tree = pf.build_tree(seqs, [0.0, 1.0, 2.0], masks)
    assert segments(tree) == [[1], [2, 3], [4, 5], [8, 9]]
    assert tree.parents == [-1, 0, 0, -1]
    flat = pf.build_tree(seqs, [0.0, 1.0, 2.0], masks, min_shared_tokens=2)
    assert segments(flat) == [[1, 2, 3], [1, 4, 5], [8, 9]]  # the one-token root is not split out
    assert flat.parents == [-1, -1, -1]
    deep = [t(1, 2, 3, 4, 5), t(1, 2, 3, 6, 7), t(1, 2, 9, 9)]
    tree = pf.build_tree(deep, [0.0, 1.0, 2.0], min_shared_tokens=2)
    assert segments(tree) == [[1, 2], [3, 4, 5], [3, 6, 7], [9, 9]]  # node [3] merged into its children
    for i, s in enumerate(deep):
        assert torch.equal(tree.path_tokens(i), s)


def test_logprobs_follow_the_paths():
    seqs = [t(1, 2, 3), t(1, 2, 4, 5)]
    old = [torch.tensor([0.0, -1.0, -2.0]), torch.tensor([0.0, -1.5, -2.5, -3.5])]
    tree = pf.build_tree(seqs, [1.0, -1.0], old_logprobs=old)
    losses = tree.path_losses()
    assert losses.response_lens == [1, 2]
    assert [x.tolist() for x in losses.old_logprobs] == [[-2.0], [-2.5, -3.5]]
    assert losses.ref_logprobs is None


def test_group_loss_masks_and_as_tree():
    group = pf.synthetic_group(97, 4, [3, 2], seed=0, with_logprobs=True)
    assert group.loss_masks is None  # RolloutGroup(P, R, adv) unchanged
    masks = [t(True, False, True).bool(), t(False, True).bool()]
    masked = pf.RolloutGroup(
        group.prompt, group.responses, group.advantages, group.old_logprobs, group.ref_logprobs,
        loss_masks=masks,
    )  # fmt: skip
    tree = masked.as_tree()
    assert tree.parents == [-1, 0, 0] and tree.path_ends == [1, 2]
    assert tree.loss_masks[0].tolist() == [False] * 4 + [True, False, True]
    assert torch.equal(tree.old_logprobs[1][4:], group.old_logprobs[1])
    assert masked.to("cpu").loss_masks[1].tolist() == [False, True]
    with pytest.raises(ValueError, match=r"loss_masks\[1\] has shape \(3,\); its sequence has 2 tokens"):
        pf.RolloutGroup(group.prompt, group.responses, group.advantages, loss_masks=[masks[0], masks[0]])
    with pytest.raises(ValueError, match=r"loss_masks\[0\] marks no token"):
        pf.RolloutGroup(
            group.prompt, group.responses, group.advantages, loss_masks=[~masks[0] & False, masks[1]]
        )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"loss_masks": [t(True, True, False).bool(), t(False, True).bool()]}, r"loss_masks\[0\] marks the"),
        ({"loss_masks": [t(False, True).bool(), t(False, True).bool()]}, r"loss_masks\[0\] has shape \(2,\)"),
        ({"old_logprobs": [torch.zeros(3), torch.zeros(3)]}, r"old_logprobs\[1\] has shape \(3,\)"),
        ({"min_shared_tokens": 0}, "min_shared_tokens must be an int >= 1"),
    ],
)
def test_build_tree_errors_name_the_field(kwargs, match):
    seqs = [t(1, 2, 3), t(1, 4)]
    with pytest.raises((ValueError, TypeError), match=match):
        pf.build_tree(seqs, [1.0, 0.0], **kwargs)


def test_build_tree_rejects_empty_sequences_and_nothing_to_train():
    with pytest.raises(ValueError, match=r"sequences\[1\] is empty"):
        pf.build_tree([t(1, 2), torch.zeros(0, dtype=torch.long)], [1.0, 0.0])
    with pytest.raises(ValueError, match=r"sequences\[1\] has none after it; pass loss_masks"):
        pf.build_tree([t(1, 2, 3), t(1, 2)], [1.0, 0.0])
    with pytest.raises(ValueError, match=r"advantages must have shape \(2,\)"):
        pf.build_tree([t(1, 2, 3), t(1, 5)], [1.0])


def hand(segs, parents, ends):
    """A hand-built tree whose structure is wrong (checked before the masks, which are placeholders)."""
    masks = [torch.tensor([False, True]) for _ in ends]
    return pf.RolloutTree(
        [torch.tensor(x, dtype=torch.long) for x in segs], parents, ends, torch.zeros(len(ends)), masks
    )


@pytest.mark.parametrize(
    "segs,parents,ends,match",
    [
        ([[1, 2], [3], [4]], [-1, 2, 1], [1], "parents form a cycle through node 1"),
        ([[1, 2], [3]], [-1, 5], [1], r"parents\[1\] = 5 is a dangling parent"),
        ([[1, 2], []], [-1, 0], [1], r"segments\[1\] is empty"),
        ([[1, 2], [3], [4]], [-1, 0, 0], [1], "node 2 is a leaf that no path ends at"),
        ([[1, 2], [3]], [-1, 0], [7], r"path_ends\[0\] = 7 is not a node"),
    ],
)
def test_hand_built_tree_errors(segs, parents, ends, match):
    with pytest.raises(ValueError, match=match):
        hand(segs, parents, ends)


def test_train_group_refuses_bad_trees_before_any_gradient_changes():
    model = tiny_model("llama3", max_seq_len=8)
    tree = pf.build_tree([t(1, 2, 3), t(1, 2, 4)], [1.0, -1.0])
    pf.train_group(model, tree)
    before = [p.grad.clone() for p in model.parameters()]
    long = pf.build_tree([t(1, 2, 3), t(1, *range(10, 20))], [1.0, -1.0])
    with pytest.raises(ValueError, match="path 1 has 11 tokens, more than the model's max_seq_len=8"):
        pf.train_group(model, long)
    vocab = pf.build_tree([t(1, 2, 3), t(1, 2, 400)], [1.0, -1.0])
    with pytest.raises(ValueError, match=r"segments\[2\] has token id 400 outside the model's vocabulary"):
        pf.train_group(model, vocab)
    with pytest.raises(ValueError, match="microbatch='auto' needs a memory budget"):
        pf.train_group(model, tree, microbatch="auto")
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))


def test_tree_refusals_name_what_is_missing():
    with pytest.raises(TypeError, match="group must be a prefixflow.RolloutGroup or RolloutTree"):
        pf.train_group(tiny_model("llama3"), [t(1, 2)])


def test_trees_run_under_any_schedule_hook():
    """Every call runs a tree, so no hook is refused for trees: a hook sees each phase of a tree's call and
    the gradients are the ones without it."""
    import contextlib

    class Phases(pf.ScheduleHooks):
        def __init__(self):
            self.seen = []

        @contextlib.contextmanager
        def phase(self, name):
            self.seen.append(name)
            yield

    tree = pf.build_tree([t(1, 2, 3), t(1, 2, 4)], [1.0, -1.0])
    want_model, model = tiny_model("llama3"), tiny_model("llama3")
    hook = pf.add_hooks(model, Phases())
    got, want = pf.train_group(model, tree), pf.train_group(want_model, tree)
    assert set(hook.seen) == {"A", "B", "C"}
    assert got.loss == pytest.approx(want.loss, rel=1e-12)
    for p, q in zip(model.parameters(), want_model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_train_step_on_one_process_trains_trees_and_groups_like_train_group():
    from prefixflow.parallel.dp import train_step

    tree = pf.build_tree([t(1, 2, 3, 5), t(1, 2, 4), t(1, 2, 4, 6, 7)], [1.0, -1.0, 0.5])
    group = pf.synthetic_group(97, 5, [3, 4], seed=1)
    want_model, model = tiny_model("llama3"), tiny_model("llama3")
    want = sum(pf.train_group(want_model, g, microbatch=1).loss for g in (tree, group))
    stats = train_step(model, [tree, group], microbatch=1)
    assert stats.loss == pytest.approx(want, rel=1e-12)
    for p, q in zip(model.parameters(), want_model.parameters(), strict=True):  # placement orders by cost
        assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-15)
