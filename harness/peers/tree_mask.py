"""The ``tree_mask`` peer (AReaL tree training, MAGI, TRL #7328): one packed sequence per microbatch with a
tree attention mask.

A microbatch is ``microbatch`` root-to-leaf paths (None = all); the union of their nodes is packed once, each
node at its own positions (its RoPE positions continue its ancestors'), and a token attends to every token of
its ancestor nodes and causally to its own node. So each node runs once *inside* a microbatch, but a node
shared by paths of different microbatches is recomputed in each of them: sharing stops at the microbatch edge.
The LM head runs only at the rows that predict a trained token, each ``(row, target)`` once per microbatch;
the loss is ``prefixflow.loss`` per ``(path, slot)`` (:mod:`harness.peers.tree_common`).
"""

from __future__ import annotations

import torch

from .tree_common import masked_sdpa, path_loss, prepare_tree, timed

__all__ = ["TreeMaskAttention", "pack_paths", "train_tree_mask"]


class TreeMaskAttention:
    """Attention mode: the packed row under its bool tree mask ``[1, 1, L, L]``."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask

    def __call__(self, wrapper, q, k, v, *, scale, enable_gqa):
        return masked_sdpa(wrapper, q, k, v, self.mask, scale, enable_gqa)


def pack_paths(inp, paths: list[int]):
    """The packed row of ``paths``: ``(tokens [1, L], positions [1, L], mask [1, 1, L, L], rows, targets,
    entries)``; ``rows``/``targets``: the scored positions, each ``(row, target)`` once; ``entries``: per loss
    entry ``(index into rows, path, slot)``."""
    tree, plan = inp.tree, inp.plan
    nodes = sorted({j for i in paths for j in tree.path_nodes(i)}, key=tree.order.index)
    start, at = {}, 0
    for j in nodes:
        start[j], at = at, at + tree.node_len(j)
    tokens = torch.cat([tree.segments[j] for j in nodes]).view(1, -1)
    positions = torch.cat(
        [tree.first_position[j] + torch.arange(tree.node_len(j), device=inp.device) for j in nodes]
    ).view(1, -1)
    local = {j: b for b, j in enumerate(nodes)}
    sees = torch.zeros(len(nodes), len(nodes), dtype=torch.bool)  # node a's queries see node b's keys
    for j in nodes:
        for a in tree.ancestors(j):
            sees[local[j], local[a]] = True
    node_of = torch.repeat_interleave(
        torch.arange(len(nodes)), torch.tensor([tree.node_len(j) for j in nodes])
    )
    q = torch.arange(at)
    same = node_of.view(-1, 1) == node_of.view(1, -1)
    mask = sees[node_of][:, node_of] | (same & (q.view(-1, 1) >= q.view(1, -1)))
    index: dict[tuple[int, int], int] = {}
    entries = []
    for i in paths:
        scored = [
            (start[node] + int(plan.node_rows[node].cols[k]), int(plan.node_rows[node].targets[k]), slot)
            for node, k, slot in plan.shared[i]
        ]
        if (row := plan.leaf_rows.get(i)) is not None:
            leaf = tree.path_ends[i]
            cols, targets, slots = row.cols.tolist(), row.targets.tolist(), row.slots.tolist()
            scored += [(start[leaf] + c, t, s) for c, t, s in zip(cols, targets, slots, strict=True)]
        for pos, target, slot in scored:
            entries.append((index.setdefault((pos, target), len(index)), i, slot))
    rows = [p for p, _ in index]
    targets = [t for _, t in index]
    return tokens, positions, mask.view(1, 1, at, at).to(inp.device), rows, targets, entries


def train_tree_mask(model, tree, *, microbatch=None, loss: str = "pg", loss_config=None, observer=None):
    """Train ``tree`` with tree-mask packing: gradients accumulate into ``param.grad`` (no zeroing).

    Returns ``prefixflow.GroupStats`` (``trunk_tokens``: the packed rows' lengths summed; one phase ``full``)."""
    from prefixflow import GroupStats
    from prefixflow.schedule.stage import forward_hidden

    inp = prepare_tree(model, tree, loss, loss_config)
    n = inp.tree.n
    size = n if microbatch is None else int(microbatch)
    chunks = [list(range(s, min(n, s + size))) for s in range(0, n, size)]
    times: dict[str, float] = {}
    total, trunk = 0.0, 0
    with timed(inp.device, observer, "full", times):
        for chunk in chunks:
            tokens, positions, mask, rows, targets, entries = pack_paths(inp, chunk)
            trunk += int(tokens.numel())
            with inp.runtime.state.use(TreeMaskAttention(mask)):
                hidden = forward_hidden(model, tokens, positions)
                logp = inp.logprobs(hidden[0, torch.tensor(rows, device=inp.device)], targets)
                at = torch.tensor([e[0] for e in entries], device=inp.device)
                value = path_loss(inp, logp[at], [e[1] for e in entries], [e[2] for e in entries])
                value.backward()
            total += value.item()
    return GroupStats(
        system="tree_mask", layout="packed", loss=total, n_microbatches=len(chunks), prefix_tokens=0,
        suffix_tokens=sum(int(m.sum()) for m in inp.tree.loss_masks), trunk_tokens=trunk, phase_times=times,
    )  # fmt: skip
