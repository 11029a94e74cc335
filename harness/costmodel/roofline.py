"""A modelled step time, labelled so: the sum over the ops that run of ``max(FLOPs / π, bytes / β)``, each
op bound by either its arithmetic or its memory traffic, with no efficiency factor and no overlap between ops
(paper §5.4's Figure 9 at the paper's size, issue 34 item 6; docs/estimate.md, "Modelled time").

- **FLOPs** per op are the counters' (``harness.costmodel.counting.op_flops``): matmuls by torch's
  ``flop_registry``, the fused SDPA calls by the pairs each computes, convolutions and triangular solves.
  Pointwise ops, reductions and copies have none: they are bound by their bytes.
- **Bytes** per op: every tensor argument read once and every output written once, at its own size (a
  view's, not its storage's). An op whose outputs are all views of its inputs (``view``, ``transpose``,
  ``expand`` ...: what its schema says) moves nothing, nor does a query that makes no tensor (``prim.device``
  under fake tensors). An in-place op's output is written once more than it is read.
- **π and β** default to the H20's: 148 TFLOP/s bf16 dense, 4.0 TB/s HBM. Collectives are ops like any other
  here (their bytes), which a real device overlaps or not; the model does not know, and says so.

Under fake tensors (``harness.estimate``) the ops run without values, so a step of Llama3-8B at 12k tokens is
modelled on a CPU. A real CPU run can be timed the same way, which is how the unit tests check the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .counting import op_flops

__all__ = ["H20_BF16_FLOPS", "H20_HBM_BYTES", "RooflineTimer", "OpCost", "op_bytes"]

H20_BF16_FLOPS = 148e12  # FLOP/s, dense bf16
H20_HBM_BYTES = 4.0e12  # bytes/s


@dataclass
class OpCost:
    """One op name's totals under a :class:`RooflineTimer`."""

    calls: int = 0
    flops: int = 0
    bytes: int = 0
    seconds: float = 0.0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def op_bytes(func, args, kwargs, out) -> int:
    """The bytes one op call moves: its tensor arguments read and its outputs written; 0 for a view (every
    output aliases an input without writing it, as its schema says) and for an op that makes no tensor."""
    rets = func._schema.returns
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    infos = [rets[0].alias_info] * len(outs) if len(rets) == 1 else [r.alias_info for r in rets]
    written = sum(
        _nbytes(o)
        for o, alias in zip(outs, infos, strict=False)
        if isinstance(o, torch.Tensor) and (alias is None or alias.is_write)
    )
    if not written:
        return 0  # a view, or a query that makes no tensor (``prim.device``, a size)
    return sum(_nbytes(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)) + written


class RooflineTimer(TorchDispatchMode):
    """Models the ops that run under it at ``flops_per_s`` and ``bytes_per_s``: ``seconds``, ``flops`` and
    ``bytes`` in all, and ``by_op`` (op name -> :class:`OpCost`)."""

    def __init__(self, flops_per_s: float = H20_BF16_FLOPS, bytes_per_s: float = H20_HBM_BYTES) -> None:
        super().__init__()
        if not (flops_per_s > 0 and bytes_per_s > 0):
            raise ValueError(
                f"the peak rates must be positive, got {flops_per_s} FLOP/s and {bytes_per_s} B/s"
            )
        self.flops_per_s, self.bytes_per_s = flops_per_s, bytes_per_s
        self.seconds, self.flops, self.bytes = 0.0, 0, 0
        self.by_op: dict[str, OpCost] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flops = op_flops(func, args, kwargs, out)
        moved = op_bytes(func, args, kwargs, out)
        seconds = max(flops / self.flops_per_s, moved / self.bytes_per_s)
        self.seconds += seconds
        self.flops += flops
        self.bytes += moved
        cost = self.by_op.setdefault(func.overloadpacket.__name__, OpCost())
        cost.calls += 1
        cost.flops += flops
        cost.bytes += moved
        cost.seconds += seconds
        return out
