"""The schedule's view of a tree: which nodes it caches, the rows it runs, and where each trained token is scored.

Token ``o`` of node ``m`` is predicted by the position before it: row ``o-1`` of ``m`` itself, or for
``o = 0`` the last row of ``m``'s parent (the first-token trap, per node: the parent scores each child's
first token). A node with children (*cached*: Phase A forwards it once and keeps its K/V) scores every
trained token it predicts, once, however many paths train it; each path reads those log-probs by index
(:attr:`TreeRows.shared`). A leaf scores its own tokens in its path's Phase-B row (the *leaf row*), which
leaves out the leaf's last token: it predicts nothing. Loss *slot* ``s`` of a path is its ``s``-th trained
token, in path order: the order of :class:`~prefixflow.tree.PathLosses`.

A flat :class:`~prefixflow.RolloutGroup` runs as :func:`group_tree`: one cached node ``P[:-1]`` and, per
response, a leaf ``[P[-1], S_i]`` that runs the last prompt token again, so its leaf row scores the first
response token itself and the cached node scores nothing (its forward may stop at the last K/V).
"""

from __future__ import annotations

import torch

from ..group import RolloutGroup
from ..schedule.host import on_host
from .layouts import Row
from .rollout_tree import RolloutTree

__all__ = ["TreeRows", "group_tree"]


def group_tree(group: RolloutGroup) -> RolloutTree:
    """The tree a flat group runs as (see the module docstring): the cached node ``P[:-1]`` (none for a
    one-token prompt: each response is then a root ``[P[0], S_i]``) and one leaf ``[P[-1], S_i]`` per response.
    Loss masks, old/ref log-probs and MoE routing carry over (a leaf's last token is never fed to the model;
    its routing row repeats the one before it)."""
    p, n = group.prompt_len, group.n
    last = group.prompt[-1:]
    leaves = [torch.cat([last, r]) for r in group.responses]
    if p > 1:
        segments, parents, ends = [group.prompt[:-1], *leaves], [-1] + [0] * n, list(range(1, n + 1))
    else:
        segments, parents, ends = leaves, [-1] * n, list(range(n))
    device = group.prompt.device
    trained = group.loss_masks or [
        torch.ones(s, dtype=torch.bool, device=device) for s in group.response_lens
    ]
    masks = [torch.cat([torch.zeros(p, dtype=torch.bool, device=m.device), m]) for m in trained]

    def over_paths(values):
        return None if values is None else [torch.cat([v.new_zeros(p), v]) for v in values]

    routing = None
    if group.routing is not None:
        prefix, suffixes = group.routing.prefix, group.routing.suffixes
        fed = [torch.cat([prefix[:, p - 1 :], s], dim=1) for s in suffixes]  # the leaf's fed tokens
        routing = [torch.cat([m, m[:, -1:]], dim=1) for m in fed]
        if p > 1:
            routing = [prefix[:, : p - 1], *routing]
    return RolloutTree(
        segments, parents, ends, group.advantages, masks, over_paths(group.old_logprobs),
        over_paths(group.ref_logprobs), routing,
        None if group.prompt_inputs is None else [group.prompt_inputs] * n,
    )  # fmt: skip


class TreeRows:
    """The rows and scores of one tree (immutable once built): ``cached`` nodes top-down, ``node_rows`` (each
    cached node's Phase-A row, scoring what it predicts), ``leaf_rows`` (path -> its Phase-B row, for paths
    with trained tokens in their leaf), ``shared`` (per path: ``(node, score index, loss slot)`` of each
    trained token a cached node scores), ``dfs_paths`` (the order Phase B runs the paths in) and ``leafless``
    (paths whose trained tokens all lie in cached nodes: their loss reads those scores alone)."""

    def __init__(self, tree: RolloutTree) -> None:
        self.tree = tree
        self.cached = [j for j in tree.order if tree.children[j]]  # top-down
        cached = set(self.cached)
        self.paths_through = self.count_through(range(tree.n))
        index: dict[int, dict[tuple[int, int], int]] = {j: {} for j in self.cached}
        scores: dict[int, tuple[list[int], list[int]]] = {j: ([], []) for j in self.cached}
        self.shared: list[list[tuple[int, int, int]]] = []
        self.leaf_rows: dict[int, Row] = {}
        for i in range(tree.n):
            nodes = tree.path_nodes(i)
            end = nodes[-1]
            start = tree.first_position[end]
            trained = tree.loss_masks[i].nonzero().flatten()
            own = trained > start if end not in cached else torch.zeros_like(trained, dtype=torch.bool)
            shared = []
            for slot in (~own).nonzero().flatten().tolist():  # tokens a cached node scores
                t = int(trained[slot])
                m = next(j for j in reversed(nodes) if tree.first_position[j] <= t)
                o = t - tree.first_position[m]
                scorer, row = (m, o - 1) if o > 0 else (tree.parents[m], tree.node_len(tree.parents[m]) - 1)
                k = index[scorer].setdefault((m, o), len(index[scorer]))
                if k == len(scores[scorer][0]):
                    scores[scorer][0].append(row)
                    scores[scorer][1].append(int(tree.segments[m][o]))
                shared.append((scorer, k, slot))
            self.shared.append(shared)
            if bool(own.any()):
                offsets = trained[own] - start
                segment = tree.segments[end]
                self.leaf_rows[i] = Row(
                    i, segment[:-1], start, tuple(nodes[:-1]), offsets - 1, segment[offsets],
                    own.nonzero().flatten(), (end,), torch.ones(len(segment) - 1),
                )  # fmt: skip
        self.node_rows = {j: self._node_row(j, *scores[j]) for j in self.cached}
        rank = {j: k for k, j in enumerate(tree.order)}
        self.dfs_paths = sorted(range(tree.n), key=lambda i: rank[tree.path_ends[i]])
        self.leafless = [i for i in self.dfs_paths if i not in self.leaf_rows]

    def _node_row(self, j: int, rows: list[int], targets: list[int]) -> Row:
        """Phase A's row of cached node ``j``: its whole segment after its ancestors; its ``slots`` are the
        score indices (where each log-prob goes in the node's scores)."""
        tree = self.tree
        through, ends = self.paths_through[j], tree.path_ends.count(j)
        weights = torch.full((tree.node_len(j),), float(through))
        weights[-1] = float(through - ends)
        long = dict(dtype=torch.long)
        return Row(
            -1, tree.segments[j], tree.first_position[j], tuple(tree.ancestors(j)), torch.tensor(rows, **long),
            torch.tensor(targets, **long), torch.arange(len(rows)), (j,), weights,
        )  # fmt: skip

    def count_through(self, paths) -> list[int]:
        """Per node, how many of ``paths`` run through it."""
        through = [0] * self.tree.n_nodes
        for i in paths:
            for j in self.tree.path_nodes(i):
                through[j] += 1
        return through

    def scores(self, j: int) -> int:
        """How many log-probs cached node ``j`` scores."""
        return len(self.node_rows[j].cols)

    def full_row(self, i: int) -> Row:
        """The baseline's row of path ``i``: the whole path but its last token, scoring every trained token."""
        with on_host():  # host planning over the caller's tensors (real under an estimate too)
            tokens = self.tree.path_tokens(i)
            trained = self.tree.loss_masks[i].nonzero().flatten()
            return Row(
                i, tokens[:-1], 0, (), trained - 1, tokens[trained], torch.arange(len(trained)),
                tuple(self.tree.path_nodes(i)), torch.ones(len(tokens) - 1),
            )  # fmt: skip

    def key_nodes(self, rows: list[Row]) -> list[int]:
        """The cached nodes some of ``rows`` read, in key (top-down) order."""
        order = {j: k for k, j in enumerate(self.tree.order)}
        return sorted({j for r in rows for j in r.ancestors}, key=order.__getitem__)

    @property
    def prefix_tokens(self) -> int:
        """Tokens whose K/V Phase A caches, each node's once."""
        return sum(self.tree.node_len(j) for j in self.cached)
