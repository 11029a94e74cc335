"""The unit of the cost model (:class:`Flops`) and the group arithmetic every FLOP model shares: response
lengths, microbatches and causal pairs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Flops", "response_lengths", "microbatches", "causal_pairs", "suffix_pairs"]


@dataclass(frozen=True)
class Flops:
    """Training FLOPs (forward + backward) of one group, by kind: ``gemm`` (the linear layers and the LM head),
    ``attention`` (the SDPA calls) and ``recurrent`` (a hybrid's recurrent mixers' sequence kernels: their
    chunked scans, short convolutions and triangular solves; 0 for dense models)."""

    gemm: int
    attention: int
    recurrent: int = 0

    @property
    def total(self) -> int:
        return self.gemm + self.attention + self.recurrent

    def __add__(self, other: Flops) -> Flops:
        return Flops(
            self.gemm + other.gemm, self.attention + other.attention, self.recurrent + other.recurrent
        )


def response_lengths(S: int | Sequence[int], N: int | None) -> list[int]:
    """One length for ``N`` responses, or the list of response lengths (checked against ``N``)."""
    lens = [int(S)] * int(N) if isinstance(S, int) else [int(s) for s in S]
    if N is not None and not isinstance(S, int) and len(lens) != N:
        raise ValueError(f"got {len(lens)} response lengths for N={N}")
    if not lens or min(lens) < 1:
        raise ValueError(f"need N >= 1 responses of length >= 1, got {lens}")
    return lens


def microbatches(n: int, microbatch: int | Sequence[int] | None) -> list[list[int]]:
    """Responses per microbatch: all (None), a fixed size, or the sizes a plan chose (``microbatch="auto"``)."""
    if microbatch is not None and not isinstance(microbatch, int):
        sizes = [int(x) for x in microbatch]
        if sum(sizes) != n or min(sizes) < 1:
            raise ValueError(f"microbatch sizes {sizes} do not split {n} responses")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [list(range(a, a + b)) for a, b in zip(starts, sizes, strict=True)]
    size = n if microbatch is None else microbatch
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def causal_pairs(n: int) -> int:
    """The (query, key) pairs of a causal call over ``n`` tokens."""
    return n * (n + 1) // 2


def suffix_pairs(T: int, widths: list[int], layout: str, attention: str) -> int:
    """Attention pairs of one Phase-B suffix microbatch (``widths``: its suffix lengths) per layer, after ``T``
    cached prefix keys. ``split``: the prefix part is one unmasked call over ``rows·T`` pairs; the suffix part
    is causal when its mask is lower-triangular (padded, or a packed row of one response), else every pair of
    its masked call (a packed row's block-diagonal mask). ``concat``: one masked call over ``[prefix ; suffix]``.
    With no cached key (a one-token prompt) a padded microbatch is full sequences: the plain causal forward."""
    if layout == "packed":
        rows = sum(widths)
        if attention == "split" and T > 0 and len(widths) == 1:
            return rows * T + causal_pairs(rows)
        return rows * T + rows * rows
    b, w = len(widths), max(widths)
    if T == 0:
        return b * causal_pairs(w)
    if attention == "split":
        return b * w * T + b * causal_pairs(w)
    return b * w * (T + w)
