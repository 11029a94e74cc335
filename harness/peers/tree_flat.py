"""The ``prefixflow_flat`` peer: today's flat PrefixFlow on a tree, sharing only the longest common prefix of
every path (the group's prompt) and training each path's remainder as a suffix.

:func:`flatten_tree` rewrites a ``RolloutTree`` as the depth-1 tree of that prefix (one root holding the
common prefix, one leaf per path with the rest; a path equal to the prefix ends at the root). The same paths,
masks, advantages and log-probs, so the objective is unchanged; ``prefixflow.train_group`` then runs its flat
three-phase schedule on it."""

from __future__ import annotations

__all__ = ["common_prefix_len", "flatten_tree", "rebuild_tree"]


def common_prefix_len(tree) -> int:
    """Tokens every path shares from its start (0 when the paths start at different roots)."""
    ancestry = [tree.path_nodes(i) for i in range(tree.n)]
    shared = 0
    for nodes in zip(*ancestry, strict=False):
        if len(set(nodes)) != 1:
            break
        shared += tree.node_len(nodes[0])
    if len(ancestry) == 1:
        return tree.path_lens[0]
    return shared


def flatten_tree(tree):
    """The depth-1 ``RolloutTree`` of ``tree``'s common prefix (a forest of whole paths when there is none)."""
    from prefixflow import RolloutTree

    p = common_prefix_len(tree)
    paths = [tree.path_tokens(i) for i in range(tree.n)]
    segments, parents, ends = [], [], []
    if p > 0:
        segments.append(paths[0][:p])
        parents.append(-1)
    for path in paths:
        if p > 0 and path.numel() == p:
            ends.append(0)
            continue
        segments.append(path[p:])
        parents.append(0 if p > 0 else -1)
        ends.append(len(segments) - 1)
    return RolloutTree(
        segments, parents, ends, tree.advantages, tree.loss_masks, tree.old_logprobs, tree.ref_logprobs
    )


def rebuild_tree(tree, min_shared_tokens):
    """``tree``'s paths (tokens, masks, advantages, log-probs) through ``prefixflow.build_tree`` again."""
    from prefixflow import build_tree

    return build_tree(
        [tree.path_tokens(i) for i in range(tree.n)], tree.advantages, loss_masks=list(tree.loss_masks),
        old_logprobs=tree.old_logprobs, ref_logprobs=tree.ref_logprobs, min_shared_tokens=min_shared_tokens,
    )  # fmt: skip
