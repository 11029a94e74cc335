"""MoE routing replay on prefix trees: per-row route plans from one recorded mask per node.

A tree's routing is one ``LongTensor[n_moe_layers, node_len, k]`` per node (``RolloutTree.routing``). A
microbatch row holds the tokens of some nodes (``Row.nodes``: a cached node's Phase-A row, a path's leaf
row, or a baseline path of all its nodes but the last token), so its expert ids are those nodes' masks
concatenated. Each token counts once per full sequence that feeds it (``Row.weights``): a cached node's
token once per path through the node (its last token not for paths that end there); a leaf row leaves out
the leaf's last token (no full sequence feeds it), so the load counters and the balance loss match the
baseline's.
"""

from __future__ import annotations

import torch

__all__ = ["check", "plan", "fractions"]


def check(tree, n_layers: int, num_experts: int, top_k: int) -> None:
    """Raise ValueError naming the field when ``tree.routing`` does not fit the tree or the model."""
    routing = tree.checked_routing()  # also when set after construction
    first = routing[0]
    if first.shape[0] != n_layers:
        raise ValueError(f"routing has masks for {first.shape[0]} MoE layers; the model has {n_layers}")
    if first.shape[2] != top_k:
        raise ValueError(f"routing masks choose top-{first.shape[2]} experts; the model routes top-{top_k}")
    for j, m in enumerate(routing):
        if m.numel() and int(m.max()) >= num_experts:
            raise ValueError(
                f"routing[{j}] has expert id {int(m.max())} outside the model's experts [0, {num_experts})"
            )


def plan(routing, mb, n_layers: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(experts [n_layers, b, L, k] or None, weight [b, L])`` for a tree microbatch (pads: -1 and 0)."""
    rows, width = mb.tokens.shape
    device = mb.tokens.device
    lens = [int(r.tokens.numel()) for r in mb.rows]
    padded = rows == len(lens)  # one row per Row; packed: all of them in one row
    starts = [j * width for j in range(len(lens))] if padded else [sum(lens[:j]) for j in range(len(lens))]
    weight = torch.zeros(rows * width, device=device)
    experts = None
    if routing is not None:
        k = routing[0].shape[2]
        experts = torch.full((n_layers, rows * width, k), -1, dtype=torch.long, device=device)
    for row, start, n in zip(mb.rows, starts, lens, strict=True):
        weight[start : start + n] = row.weights.to(device)
        if experts is not None:
            masks = torch.cat([routing[j] for j in row.nodes], dim=1)[:, :n]
            experts[:, start : start + n] = masks.to(device)
    if experts is not None:
        experts = experts.view(n_layers, rows, width, -1)
    return experts, weight.view(rows, width)


def fractions(tree, routing, num_experts: int, k: int) -> list[torch.Tensor]:
    """Per layer ``f_e / T``: the fraction of the paths' routed slots on expert e over the ``T`` tokens the
    full sequences feed (each path's tokens but its last), divided by ``T``."""
    lengths = tree.path_lens
    tokens = sum(n - 1 for n in lengths)
    out = []
    for layer in range(routing[0].shape[0]):
        counts = torch.zeros(num_experts, dtype=torch.long, device=routing[0].device)
        for i in range(tree.n):
            fed = torch.cat([routing[j][layer] for j in tree.path_nodes(i)])[: lengths[i] - 1]
            counts += torch.bincount(fed.reshape(-1), minlength=num_experts)
        out.append(counts.double() / (tokens * k) / tokens)
    return out
