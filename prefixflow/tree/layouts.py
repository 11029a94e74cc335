"""Padded and packed microbatches of rows: tokens, RoPE positions, attention masks and loss positions.

Every shape lays out the same thing: :class:`Row` s, each a run of tokens at its positions that reads the
cached K/V of some nodes (its ancestors) and scores some of its positions (:mod:`prefixflow.tree.plan` makes
them: a cached node's Phase-A row, a path's leaf row, a path's full-sequence row for the baseline). A row
sees every key of its ancestors, its own tokens causally, never another row's tokens, never a pad.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..schedule.host import on_host

__all__ = ["Row", "Microbatch", "lay_out", "mask_bytes", "LAYOUTS"]

LAYOUTS = ("padded", "packed")


@dataclass(frozen=True)
class Row:
    """One sequence of a microbatch: ``tokens`` at positions ``first_position ..``, reading the cached K/V of
    ``ancestors`` (nodes, root first). ``cols``/``targets``/``slots`` (LongTensors): its scored positions, the
    tokens they predict and the loss slots of ``path`` they fill (a cached node's row: the index of each score
    in the node's scores). ``nodes``: the nodes whose tokens it holds, in order (MoE routing replay reads their
    masks); ``weights``: how many full-sequence tokens each of its tokens stands for (the logical token
    accounting of MoE load counters)."""

    path: int  # the path it trains; -1 for a cached node's row
    tokens: torch.Tensor
    first_position: int
    ancestors: tuple[int, ...]
    cols: torch.Tensor
    targets: torch.Tensor
    slots: torch.Tensor
    nodes: tuple[int, ...] = ()
    weights: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.numel())


@dataclass
class Microbatch:
    tokens: torch.Tensor  # [b, L]
    positions: torch.Tensor | None  # [1 or b, L]; None = 0..L-1 (the plain model's default)
    mask: torch.Tensor | None  # bool [b, 1, L, U + L] (U cached keys); None = plain causal
    loss_rows: torch.Tensor  # [T] row of each scored position
    loss_cols: torch.Tensor  # [T] column of each scored position
    targets: torch.Tensor  # [T] token each scored position predicts
    response_ids: torch.Tensor  # [T] path of each scored position
    token_ids: torch.Tensor  # [T] loss slot of each scored position within its path
    responses: tuple[int, ...] = ()  # the paths of the rows, in row/packing order
    cached_keys: int = 0  # U: cached keys before the tokens (the key nodes' tokens)
    # When the tokens are spread over ranks (context parallelism): an object whose ``gather(k, v)`` returns
    # the K/V of the whole sequence in token order, differentiably; ``length`` = that sequence's length. The
    # mask then has this rank's query rows over every key. None: every token of the microbatch is here.
    sequence: object | None = None
    # Plain causal attention over the tokens is exact on every row that carries loss (padded: a real query's
    # visible own keys are exactly its causal predecessors; pad rows feed nothing real; packed: one row). Known
    # on the host, so the mask need not be inspected (it has no values under an estimate's fake tensors).
    causal_suffix: bool = False
    # Every row sees every cached key (a flat group's suffixes; a tree microbatch whose rows share ancestors).
    keys_visible: bool = True
    # Log-probs of this microbatch's paths' trained tokens that cached nodes scored in Phase A, as
    # ``(logprobs, path ids, loss slots)``; the loss joins them to the tokens scored here.
    shared_logprobs: tuple | None = None
    rows: tuple[Row, ...] = ()  # the rows it lays out, in row/packing order
    # Per wrapped layer, a mask that replaces ``mask`` there (a sliding window: prefixflow.tree.masks).
    layer_masks: dict[int, torch.Tensor] | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.numel())


def lay_out(
    rows: list[Row], key_nodes: list[int], node_lens: list[int], layout: str, device: torch.device
) -> Microbatch:
    """Lay ``rows`` out as one microbatch over the concatenated cached K/V of ``key_nodes`` (every node some row
    reads, in key order; ``node_lens``: the tokens of every node of the tree)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} unknown; valid layouts: {LAYOUTS}")
    # Tokens, positions and index tensors are O(tokens) host work (real even under an estimate's fake tensors,
    # schedule.host); the O(tokens^2) masks are built in the ambient mode (fake there).
    with on_host():
        starts, n_keys = {}, 0
        for j in key_nodes:
            starts[j], n_keys = n_keys, n_keys + node_lens[j]
        visible = torch.zeros(len(rows), n_keys, dtype=torch.bool)
        for b, r in enumerate(rows):
            for j in r.ancestors:
                visible[b, starts[j] : starts[j] + node_lens[j]] = True
        keys_visible = bool(visible.all())
    lens = [len(r) for r in rows]
    firsts = {r.first_position for r in rows}
    # No mask where plain causal attention is exact: full sequences (padded). A packed row keeps its mask: the
    # cost model and the compiled graphs count one attention kind per layout (counted by the preflight)
    plain = layout == "padded" and n_keys == 0 and firsts == {0}
    if layout == "padded":
        width = max(lens)
        with on_host():
            tokens = torch.zeros(len(rows), width, dtype=torch.long)
            for b, r in enumerate(rows):
                tokens[b, : lens[b]] = r.tokens
            q = torch.arange(width)
            if len(firsts) == 1:  # one row of positions serves the batch
                positions = (q + firsts.pop()).unsqueeze(0)
            else:
                positions = torch.zeros(len(rows), width, dtype=torch.long)  # pads sit at position 0
                for b, r in enumerate(rows):
                    positions[b, : lens[b]] = r.first_position + q[: lens[b]]
            real = None if plain else q.unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
        if plain:
            positions, mask = None, None  # full sequences: the plain causal forward
        else:
            own = (q.view(1, -1, 1) >= q.view(1, 1, -1)) & real.unsqueeze(1)
            mask = torch.cat([visible.unsqueeze(1).expand(-1, width, -1), own], dim=2).unsqueeze(1)
        offsets = [0] * len(rows)
        row_of = list(range(len(rows)))
    else:
        with on_host():
            tokens = torch.cat([r.tokens for r in rows]).unsqueeze(0)
            positions = torch.cat([r.first_position + torch.arange(n) for r, n in zip(rows, lens, strict=True)])
            positions = positions.unsqueeze(0)
            seg = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lens))
            q = torch.arange(int(seg.numel()))
            offsets = torch.tensor([0, *lens]).cumsum(0).tolist()
        own = (seg.view(-1, 1) == seg.view(1, -1)) & (q.view(-1, 1) >= q.view(1, -1))
        mask = torch.cat([visible[seg], own], dim=1).view(1, 1, own.shape[0], -1)
        row_of = [0] * len(rows)
    with on_host():
        index = [
            torch.cat([torch.full((len(r.cols),), row_of[b], dtype=torch.long) for b, r in enumerate(rows)]),
            torch.cat([r.cols + offsets[b] for b, r in enumerate(rows)]),
            torch.cat([r.targets for r in rows]),
            torch.cat([torch.full((len(r.cols),), r.path, dtype=torch.long) for r in rows]),
            torch.cat([r.slots for r in rows]),
        ]
        loss_rows, cols, targets, paths, slots = (t.to(device) for t in index)
    return Microbatch(
        tokens=tokens.to(device),
        positions=None if positions is None else positions.to(device),
        mask=None if mask is None else mask.to(device),
        loss_rows=loss_rows, loss_cols=cols, targets=targets, response_ids=paths, token_ids=slots,
        responses=tuple(r.path for r in rows), cached_keys=n_keys,
        causal_suffix=layout == "padded" or len(rows) == 1,
        keys_visible=keys_visible, rows=tuple(rows),
    )  # fmt: skip


def mask_bytes(row_lens: list[int], n_keys: int, layout: str, *, full_sequences: bool = False) -> int:
    """Peak bytes of the bool masks :func:`lay_out` builds for rows of ``row_lens`` tokens over ``n_keys``
    cached keys (``full_sequences``: every row starts at position 0); 0 where it builds none. What a memory
    preflight counts before any of them is allocated."""
    rows, total, width = len(row_lens), sum(row_lens), max(row_lens, default=0)
    if n_keys == 0 and full_sequences and layout == "padded":
        return 0
    if layout == "padded":  # own [b, L, L] beside the mask [b, L, U + L]
        return rows * width * width + rows * width * (n_keys + width)
    # own's operands and result (3 T x T), the keys' rows (T x U), the mask (T x (U + T))
    return 3 * total * total + total * n_keys + total * (n_keys + total)
