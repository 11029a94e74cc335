"""Attention beyond plain causal, per microbatch: sliding windows and bidirectional blocks.

:class:`MaskRules` turns a laid-out :class:`~prefixflow.tree.layouts.Microbatch` into the masks a model's own
forward would apply to the same tokens of the full sequences:

- ``windows``: a layer with a sliding window ``w`` sees a key only when ``k_pos > q_pos - w`` (transformers'
  ``sliding_window_overlay``), cached keys included: each row's keys are placed at their tree positions, so a
  suffix query past the window no longer sees the start of the prefix;
- ``blocks``: spans of a path's tokens that attend to each other both ways (Gemma-3's image tokens under
  ``token_type_ids``). A span lies inside one node (the adapter checks that no node cuts one), so it only
  changes the rows that hold it, among their own tokens.

The full-attention mask goes to ``Microbatch.mask`` (with the blocks); each windowed layer gets its own mask
(``Microbatch.layer_masks``), which the attention modes read in place of ``mask`` for that layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .layouts import Microbatch

__all__ = ["MaskRules"]


@dataclass(frozen=True)
class MaskRules:
    """``windows``: wrapped layer index -> sliding window; ``blocks``: per path, ``[start, end)`` spans (path
    positions) that attend both ways; ``path_of_node``: a path through each node (a node row's spans are
    read from it)."""

    windows: dict[int, int] = field(default_factory=dict)
    blocks: list[list[tuple[int, int]]] | None = None
    path_of_node: dict[int, int] = field(default_factory=dict)

    def apply(self, mb: Microbatch, key_nodes: list[int], tree) -> Microbatch:
        """``mb`` with the rules' masks (unchanged when none of them changes what any query sees)."""
        rows = mb.rows
        padded = mb.tokens.shape[0] == len(rows)
        lens = [len(r) for r in rows]
        width = mb.tokens.shape[1]
        device = mb.tokens.device
        key_pos = [tree.first_position[j] + torch.arange(tree.node_len(j)) for j in key_nodes]
        key_pos = torch.cat(key_pos) if key_pos else torch.zeros(0, dtype=torch.long)
        n_keys = int(key_pos.numel())
        qpos = torch.zeros(mb.tokens.shape[0], width, dtype=torch.long)
        spans = []  # (batch row, first column of the row's tokens, [start, end) in the row's own tokens)
        offset = 0
        for b, r in enumerate(rows):
            at, col = (b, 0) if padded else (0, offset)
            qpos[at, col : col + lens[b]] = r.first_position + torch.arange(lens[b])
            path = r.path if r.path >= 0 else self.path_of_node.get(r.nodes[0], -1)
            for s, e in self.blocks[path] if self.blocks and path >= 0 else []:
                s, e = max(s, r.first_position), min(e, r.first_position + lens[b])
                if e - s > 1:
                    spans.append((at, col, s - r.first_position, e - r.first_position))
            offset += lens[b]
        lowest = int(key_pos.min()) if n_keys else 0
        reach = int(qpos.max()) - min(lowest, int(qpos.min()))
        windows = {layer: w for layer, w in self.windows.items() if reach >= w}
        if not spans and not windows:
            return mb
        mask = mb.mask
        if mask is None:  # full rows, padded: own tokens causally, never a pad
            q = torch.arange(width)
            real = q.unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
            mask = ((q.view(1, -1, 1) >= q.view(1, 1, -1)) & real.unsqueeze(1)).unsqueeze(1)
        mask = mask.clone().cpu()
        for at, col, s, e in spans:
            mask[at, 0, col + s : col + e, n_keys + col + s : n_keys + col + e] = True
        kpos = torch.cat([key_pos.view(1, -1).expand(qpos.shape[0], -1), qpos], dim=1)
        layer_masks = {}
        by_window: dict[int, torch.Tensor] = {}
        for layer, w in windows.items():
            if w not in by_window:
                inside = kpos.unsqueeze(1) > qpos.unsqueeze(2) - w  # [b, L, U + L]
                by_window[w] = (mask & inside.unsqueeze(1)).to(device)
            layer_masks[layer] = by_window[w]
        return dataclasses.replace(
            mb, mask=mask.to(device), layer_masks=layer_masks or None,
            causal_suffix=mb.causal_suffix and not spans,
        )  # fmt: skip
