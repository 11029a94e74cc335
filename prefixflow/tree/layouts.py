"""Padded and packed microbatches: tokens, RoPE positions, attention masks and loss positions.

Both systems describe their work as *segments*, one per response, and share the layout code:

- baseline:   input ``[P, S_1 .. S_{n-1}]`` at positions ``0 ..``, loss from position ``|P|-1``
- PrefixFlow: the cache holds ``P[:-1]``; input ``[P[-1], S_1 .. S_{n-1}]`` at positions ``|P|-1 ..``,
  loss from its first token (the last prompt token predicts the first response token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..group import RolloutGroup

__all__ = [
    "Segment",
    "Microbatch",
    "full_sequence_segments",
    "suffix_segments",
    "build_microbatch",
    "prefix_microbatch",
    "LAYOUTS",
]

LAYOUTS = ("padded", "packed")


@dataclass
class Segment:
    response: int  # index of the response in the group
    tokens: torch.Tensor  # input token ids, 1-D
    first_position: int  # RoPE position of tokens[0]
    loss_from: int  # index in tokens whose prediction is the first response token


@dataclass
class Microbatch:
    tokens: torch.Tensor  # [b, L]
    positions: torch.Tensor | None  # [1 or b, L]; None = 0..L-1 (the plain model's default)
    mask: torch.Tensor | None  # bool [b, 1, L, P_c + L]; None = plain causal
    loss_rows: torch.Tensor  # [T] row of each loss position
    loss_cols: torch.Tensor  # [T] column of each loss position
    targets: torch.Tensor  # [T] token each loss position predicts
    response_ids: torch.Tensor  # [T] response index of each loss position
    token_ids: torch.Tensor  # [T] index of the predicted token within its response
    responses: tuple[int, ...] = ()  # the group's responses in this microbatch, in row/packing order
    cached_prefix_len: int | None = None  # keys before the tokens (PrefixFlow); None = full sequences
    # When the tokens are spread over ranks (context parallelism): an object whose ``gather(k, v)`` returns
    # the K/V of the whole sequence in token order, differentiably; ``length`` = that sequence's length. The
    # mask then has this rank's query rows over every key. None: every token of the microbatch is here.
    sequence: object | None = None
    # Plain causal attention over the tokens is exact on every row that carries loss (padded: a real query's
    # visible own keys are exactly its causal predecessors; pad rows feed nothing real).
    causal_suffix: bool = False
    # Prefix trees: log-probs of this microbatch's paths' trained tokens that ancestor nodes scored in Phase A,
    # as ``(logprobs, path ids, loss slots)``; the loss joins them to the tokens scored here.
    shared_logprobs: tuple | None = None
    # Prefix trees: the rows (``prefixflow.tree.plan.TreeRow``) this microbatch lays out, in row/packing order.
    tree_rows: tuple | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.numel())


def full_sequence_segments(group: RolloutGroup) -> list[Segment]:
    """The baseline's ``[P || S_i]`` sequences (last response token dropped: it predicts nothing)."""
    p = group.prompt_len
    return [Segment(i, torch.cat([group.prompt, r[:-1]]), 0, p - 1) for i, r in enumerate(group.responses)]


def suffix_segments(group: RolloutGroup) -> list[Segment]:
    """PrefixFlow's suffix inputs ``[P[-1], S_1 .. S_{n-1}]`` after a cached prefix of ``|P|-1`` tokens."""
    p = group.prompt_len
    return [
        Segment(i, torch.cat([group.prompt[-1:], r[:-1]]), p - 1, 0) for i, r in enumerate(group.responses)
    ]


def _loss_index(group: RolloutGroup, segments: list[Segment], row_of, col_of):
    rows, cols, targets, resp, tok = [], [], [], [], []
    for j, seg in enumerate(segments):
        n = group.response_lens[seg.response]
        idx = torch.arange(n)
        rows.append(torch.full((n,), row_of(j), dtype=torch.long))
        cols.append(col_of(j) + seg.loss_from + idx)
        targets.append(group.responses[seg.response])
        resp.append(torch.full((n,), seg.response, dtype=torch.long))
        tok.append(idx)
    return [torch.cat(x) for x in (rows, cols, targets, resp, tok)]


def prefix_microbatch(group: RolloutGroup, device: torch.device) -> Microbatch:
    """Phase A's input: the cached prefix ``P[:-1]`` as one causal row at positions ``0 ..`` (no loss)."""
    empty = torch.zeros(0, dtype=torch.long, device=device)
    return Microbatch(
        tokens=group.prompt[:-1].unsqueeze(0).to(device),
        positions=None,
        mask=None,
        loss_rows=empty,
        loss_cols=empty,
        targets=empty,
        response_ids=empty,
        token_ids=empty,
    )


def build_microbatch(
    group: RolloutGroup,
    segments: list[Segment],
    layout: str,
    *,
    cached_prefix_len: int | None,
    device: torch.device,
) -> Microbatch:
    """Lay ``segments`` out as one microbatch.

    ``cached_prefix_len``: ``None`` for the baseline (no cache; padded needs no mask at all), else the number
    of cached prefix keys every query may see (0 for a one-token prompt).
    """
    lens = [int(s.tokens.numel()) for s in segments]
    n_prefix = cached_prefix_len or 0
    if layout == "padded":
        width = max(lens)
        tokens = torch.zeros(len(segments), width, dtype=torch.long)
        for j, seg in enumerate(segments):
            tokens[j, : lens[j]] = seg.tokens
        firsts = {s.first_position for s in segments}
        positions = None
        if firsts != {0}:
            # Every suffix starts at the same position, so one row serves the batch.
            positions = (torch.arange(width) + firsts.pop()).unsqueeze(0)
        mask = None
        if cached_prefix_len is not None:
            q = torch.arange(width)
            key_ok = q.unsqueeze(0) < torch.tensor(lens).unsqueeze(1)  # [b, L] real (non-pad) keys
            own = (q.view(1, -1, 1) >= q.view(1, 1, -1)) & key_ok.unsqueeze(1)  # [b, L, L]
            prefix = torch.ones(len(segments), width, n_prefix, dtype=torch.bool)
            mask = torch.cat([prefix, own], dim=2).unsqueeze(1)
        index = _loss_index(group, segments, lambda j: j, lambda j: 0)
    elif layout == "packed":
        starts = torch.tensor([0] + lens).cumsum(0)
        tokens = torch.cat([s.tokens for s in segments]).unsqueeze(0)
        positions = torch.cat(
            [s.first_position + torch.arange(n) for s, n in zip(segments, lens, strict=True)]
        )
        positions = positions.unsqueeze(0)
        seg_id = torch.repeat_interleave(torch.arange(len(segments)), torch.tensor(lens))
        q = torch.arange(int(starts[-1]))
        own = (seg_id.view(-1, 1) == seg_id.view(1, -1)) & (q.view(-1, 1) >= q.view(1, -1))
        prefix = torch.ones(own.shape[0], n_prefix, dtype=torch.bool)
        mask = torch.cat([prefix, own], dim=1).view(1, 1, own.shape[0], -1)
        index = _loss_index(group, segments, lambda j: 0, lambda j: int(starts[j]))
    else:
        raise ValueError(f"layout {layout!r} unknown; valid layouts: {LAYOUTS}")
    rows, cols, targets, resp, tok = (t.to(device) for t in index)
    return Microbatch(
        tokens=tokens.to(device),
        positions=None if positions is None else positions.to(device),
        mask=None if mask is None else mask.to(device),
        loss_rows=rows,
        loss_cols=cols,
        targets=targets,
        response_ids=resp,
        token_ids=tok,
        responses=tuple(s.response for s in segments),
        cached_prefix_len=cached_prefix_len,
        causal_suffix=layout == "padded",
    )
