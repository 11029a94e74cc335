"""Issue 36.10 / 36.11: hand-built trees take numpy / torch node indices, and ``build_tree`` on one very long
path is fast (a radix trie over runs of tokens, not a per-token Python trie)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from prefixflow import RolloutTree, build_tree

SEGMENTS = [torch.tensor([1, 2]), torch.tensor([3, 4])]
MASKS = [torch.tensor([False, False, True, True])]


@pytest.mark.parametrize(
    "parents", [[-1, np.int64(0)], torch.tensor([-1, 0]), np.array([-1, 0]), [None, torch.tensor(0)]]
)
def test_integer_likes_are_node_indices(parents):
    tree = RolloutTree(SEGMENTS, parents, [np.int64(1)], [1.0], MASKS)
    assert tree.parents == [-1, 0] and tree.path_ends == [1]
    assert all(type(p) is int for p in tree.parents + tree.path_ends)


@pytest.mark.parametrize(
    "parents, text",
    [
        ([-1, np.int64(5)], r"parents\[1\] = 5 is a dangling parent: no node 5 in the tree"),
        ([-1, 0.0], r"parents\[1\] = 0.0 is not a node index"),
        ([-1, True], r"parents\[1\] = True is not a node index"),
        (torch.tensor([-1.0, 0.0]), r"parents must be a list \(or 1-D integer tensor\) of node indices"),
        ([-1, 0, 0], r"parents has 3 entries; the tree has 2 nodes"),
    ],
)
def test_bad_indices_name_the_entry(parents, text):
    with pytest.raises(ValueError, match=text):
        RolloutTree(SEGMENTS, parents, [1], [1.0], MASKS)


def test_one_million_token_path_builds_in_under_a_second():
    seq = torch.randint(0, 1000, (1_000_000,), generator=torch.Generator().manual_seed(0))
    branch = torch.cat([seq[:500_000], torch.tensor([1001, 1002])])
    times = []
    for _ in range(3):  # the fastest of three: a busy machine slows a run, never speeds one up
        start = time.perf_counter()
        tree = build_tree([seq, branch], [1.0, -1.0])  # loss_masks=None: after the common prefix
        times.append(time.perf_counter() - start)
    assert min(times) < 1.0, times
    assert tree.n_nodes == 3 and tree.path_lens == [1_000_000, 500_002]
    assert tree.node_len(0) == 500_000 and tree.parents == [-1, 0, 0]
