"""Where each trained token of a prefix tree is scored, and the rows of the tree's microbatches.

Token ``o`` of node ``m`` is predicted by the position before it: row ``o-1`` of ``m`` itself, or for
``o = 0`` the last row of ``m``'s parent (the first-token trap, per node: the parent scores each child's
first token). A node with children (*cached*: Phase A forwards it once and keeps its K/V) scores every
trained token it predicts, once, however many paths train it; each path reads those log-probs by index
(:attr:`TreePlan.shared`). A leaf scores its own tokens in its path's Phase-B row. Loss *slot* ``s`` of a
path is its ``s``-th trained token, in path order: the order of :class:`~prefixflow.tree.PathLosses`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layouts import Microbatch
from .rollout_tree import RolloutTree

__all__ = ["TreeRow", "TreePlan", "tree_microbatch"]


@dataclass
class TreeRow:
    """One sequence of a microbatch: ``tokens`` at positions ``first_position ..``, reading the cached K/V of
    ``ancestors`` (nodes, root first); ``cols``/``targets``/``slots``: its scored positions, the tokens they
    predict and the loss slots of ``path`` they fill; ``nodes``: the nodes whose tokens it holds, in order
    (MoE routing replay reads their masks); ``weights``: how many full-sequence tokens each of its tokens
    stands for (the logical token accounting of MoE load counters)."""

    path: int
    tokens: torch.Tensor
    first_position: int
    ancestors: tuple[int, ...]
    cols: list[int]
    targets: list[int]
    slots: list[int]
    nodes: tuple[int, ...] = ()
    weights: list[float] | None = None


class TreePlan:
    """The scoring plan of one tree: cached nodes top-down, what each scores, what each path reads."""

    def __init__(self, tree: RolloutTree) -> None:
        self.tree = tree
        self.trunk_tokens = 0  # token slots the phases ran (pads included), counted as they build rows
        self.node_times: dict[int, dict[str, float]] = {}  # cached node -> {"A": s, "C": s}
        self.leafless_units = 0  # objective-only microbatches run (paths with no leaf row)
        self.peak_live_nodes = 0  # most cached nodes live at once, and their K/V bytes
        self.peak_cache_bytes = 0
        self.cached = [j for j in tree.order if tree.children[j]]  # top-down
        self.paths_through = [0] * tree.n_nodes
        for i in range(tree.n):
            for j in tree.path_nodes(i):
                self.paths_through[j] += 1
        index: dict[int, dict[tuple[int, int], int]] = {j: {} for j in self.cached}
        self.scores: dict[int, tuple[list[int], list[int]]] = {j: ([], []) for j in self.cached}
        self.shared: list[list[tuple[int, int, int]]] = []  # per path: (node, index in its scores, slot)
        self.leaf_rows: dict[int, TreeRow] = {}  # path -> its Phase-B row (paths with leaf loss tokens)
        tokens = [seg.tolist() for seg in tree.segments]  # host copies: no device sync per token
        for i in range(tree.n):
            nodes = tree.path_nodes(i)
            node_of = torch.repeat_interleave(
                torch.tensor(nodes), torch.tensor([tree.node_len(j) for j in nodes])
            ).tolist()
            leaf_len = tree.node_len(nodes[-1])
            shared, own = [], TreeRow(i, tree.segments[nodes[-1]], tree.first_position[nodes[-1]],
                                      tuple(nodes[:-1]), [], [], [], (nodes[-1],),
                                      [1.0] * (leaf_len - 1) + [0.0])  # fmt: skip
            for slot, t in enumerate(tree.loss_masks[i].nonzero().flatten().tolist()):
                m = node_of[t]
                o = t - tree.first_position[m]
                scorer, row = (m, o - 1) if o > 0 else (tree.parents[m], tree.node_len(tree.parents[m]) - 1)
                target = tokens[m][o]
                if scorer in index:
                    k = index[scorer].setdefault((m, o), len(index[scorer]))
                    if k == len(self.scores[scorer][0]):
                        self.scores[scorer][0].append(row)
                        self.scores[scorer][1].append(target)
                    shared.append((scorer, k, slot))
                else:
                    own.cols.append(row)
                    own.targets.append(target)
                    own.slots.append(slot)
            self.shared.append(shared)
            if own.cols:
                self.leaf_rows[i] = own
        # paths in depth-first order (of the node each ends at): the order Phase B runs them in
        rank = {j: k for k, j in enumerate(tree.order)}
        self.dfs_paths = sorted(range(tree.n), key=lambda i: rank[tree.path_ends[i]])
        # paths whose trained tokens all lie in cached nodes: no Phase-B row, their loss reads those leaves
        self.leafless = [i for i in self.dfs_paths if i not in self.leaf_rows]

    def node_row(self, j: int) -> TreeRow:
        """Phase A's row of cached node ``j``: its whole segment after its ancestors; its ``slots`` are the
        score indices (where each log-prob goes in the node's scores)."""
        tree = self.tree
        rows, targets = self.scores[j]
        through, ends = self.paths_through[j], tree.path_ends.count(j)
        weights = [float(through)] * (tree.node_len(j) - 1) + [float(through - ends)]
        return TreeRow(
            -1, tree.segments[j], tree.first_position[j], tuple(tree.ancestors(j)), rows, targets,
            list(range(len(rows))), (j,), weights,
        )  # fmt: skip

    def full_row(self, i: int) -> TreeRow:
        """The baseline's row of path ``i``: the whole path but its last token, scoring every trained token."""
        tokens = self.tree.path_tokens(i)
        ts = self.tree.loss_masks[i].nonzero().flatten().tolist()
        nodes = tuple(self.tree.path_nodes(i))
        return TreeRow(
            i, tokens[:-1], 0, (), [t - 1 for t in ts], tokens[ts].tolist(), list(range(len(ts))), nodes,
            [1.0] * (len(tokens) - 1),
        )  # fmt: skip

    @property
    def prefix_tokens(self) -> int:
        """Tokens whose K/V Phase A caches, each node's once."""
        return sum(self.tree.node_len(j) for j in self.cached)


def tree_microbatch(
    tree: RolloutTree, rows: list[TreeRow], layout: str, device: torch.device
) -> tuple[Microbatch, list[int]]:
    """Lay ``rows`` out as one microbatch over the concatenated cached K/V of every node some row reads
    (returned, in key order); each row's mask admits its own ancestors' keys and its own tokens causally."""
    key_nodes = sorted({j for r in rows for j in r.ancestors}, key=tree.order.index)
    starts, n_keys = {}, 0
    for j in key_nodes:
        starts[j], n_keys = n_keys, n_keys + tree.node_len(j)
    visible = torch.zeros(len(rows), n_keys, dtype=torch.bool)
    for b, r in enumerate(rows):
        for j in r.ancestors:
            visible[b, starts[j] : starts[j] + tree.node_len(j)] = True
    lens = [int(r.tokens.numel()) for r in rows]
    loss = [[], [], [], [], []]  # rows, cols, targets, paths, slots
    if layout == "padded":
        width = max(lens)
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        positions = torch.zeros(len(rows), width, dtype=torch.long)  # pads sit at position 0
        for b, r in enumerate(rows):
            tokens[b, : lens[b]] = r.tokens
            positions[b, : lens[b]] = r.first_position + torch.arange(lens[b])
        q = torch.arange(width)
        real = q.unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
        own = (q.view(1, -1, 1) >= q.view(1, 1, -1)) & real.unsqueeze(1)
        mask = torch.cat([visible.unsqueeze(1).expand(-1, width, -1), own], dim=2).unsqueeze(1)
        offsets = [0] * len(rows)
        row_of = list(range(len(rows)))
        if n_keys == 0 and all(r.first_position == 0 for r in rows):
            positions, mask = None, None  # full sequences: the plain causal forward
    elif layout == "packed":
        tokens = torch.cat([r.tokens for r in rows]).unsqueeze(0)
        positions = torch.cat(
            [r.first_position + torch.arange(n) for r, n in zip(rows, lens, strict=True)]
        ).unsqueeze(0)
        seg = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lens))
        q = torch.arange(int(seg.numel()))
        own = (seg.view(-1, 1) == seg.view(1, -1)) & (q.view(-1, 1) >= q.view(1, -1))
        mask = torch.cat([visible[seg], own], dim=1).view(1, 1, own.shape[0], -1)
        offsets = torch.tensor([0, *lens]).cumsum(0).tolist()
        row_of = [0] * len(rows)
    else:
        raise ValueError(f"layout {layout!r} unknown")
    for b, r in enumerate(rows):
        loss[0] += [row_of[b]] * len(r.cols)
        loss[1] += [offsets[b] + c for c in r.cols]
        loss[2] += r.targets
        loss[3] += [r.path] * len(r.cols)
        loss[4] += r.slots
    rows_t, cols, targets, paths, slots = (torch.tensor(x, dtype=torch.long, device=device) for x in loss)
    mb = Microbatch(
        tokens=tokens.to(device),
        positions=None if positions is None else positions.to(device),
        mask=None if mask is None else mask.to(device),
        loss_rows=rows_t, loss_cols=cols, targets=targets, response_ids=paths, token_ids=slots,
        responses=tuple(r.path for r in rows), cached_prefix_len=n_keys, tree_rows=tuple(rows),
    )  # fmt: skip
    return mb, key_nodes
