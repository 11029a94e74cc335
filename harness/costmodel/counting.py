"""Counting the FLOPs that run: three dispatch counters, which change neither the ops that run nor what stays
alive.

- **GEMMs** (``mm``, ``addmm``: the linear layers and the LM head) and **batched matmuls** (``bmm``,
  ``baddbmm``: in these models only the recurrent mixers' chunked kernels issue them, GDN's ``@`` on 4-D/5-D
  tensors and Mamba-2's einsums) (:class:`MatmulCounter`): torch's ``flop_registry`` formulas, as
  FlopCounterMode counts them, without FlopCounterMode. Its module tracker registers multi-grad hooks on the
  tensors of every module call, an activation checkpoint's recompute in the backward included, and they keep
  the recomputed tensors alive until the backward ends; and it decomposes ops it has no formula for
  (``silu_backward`` into its pointwise parts), which allocates temporaries the real kernel does not. Under
  it, full AC's backward peaked at 2.8x its real peak (llama3 dim 256, 4 layers, 1,024 tokens, fp32: 112
  against 39 MiB; the tracker alone 98, the decomposition alone 47).
- **Attention** (:class:`AttentionCounter`): FlopCounterMode ignores causality (and does not see CPU flash
  attention at all), so the fused SDPA calls are counted by the pairs each one computes.
- **Convolutions and triangular solves** (:class:`KernelCounter`): FlopCounterMode counts a grouped
  convolution's weight gradient as if it were dense (``C_out·C_in`` instead of ``C_out·C_in/groups``: a
  depthwise convolution's by ``C`` times too much), and it does not see ``linalg_solve_triangular`` (GDN's UT
  transform) at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from .work import Flops, causal_pairs

__all__ = [
    "AttentionCounter", "KernelCounter", "MatmulCounter", "count_flops", "op_flops", "GEMM_OPS", "BATCHED_OPS",
]  # fmt: skip

GEMM_OPS = ("mm", "addmm")
BATCHED_OPS = ("bmm", "baddbmm")

# fused SDPA op -> position of its is_causal argument (ATen schemas of torch 2.13)
_SDPA_FORWARD = {
    "_scaled_dot_product_flash_attention_for_cpu": 4,
    "_scaled_dot_product_flash_attention": 4,
    "_scaled_dot_product_efficient_attention": 6,
    "_scaled_dot_product_cudnn_attention": 6,
}
_SDPA_BACKWARD = {
    "_scaled_dot_product_flash_attention_for_cpu_backward": 7,
    "_scaled_dot_product_flash_attention_backward": 11,
    "_scaled_dot_product_efficient_attention_backward": 11,
    "_scaled_dot_product_cudnn_attention_backward": 14,
}


class MatmulCounter(TorchDispatchMode):
    """FLOPs of the GEMMs and batched matmuls that run under it (``counts``: op name -> FLOPs), by torch's
    ``flop_registry`` formulas."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = dict.fromkeys((*GEMM_OPS, *BATCHED_OPS), 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in self.counts:
            self.counts[name] += matmul_flops(func, args, kwargs, out)
        return out


def attention_flops(name: str, args, kwargs) -> int:
    """FLOPs of one fused SDPA call named ``name`` (0 for any other op): ``4·hd`` per (query, key) pair and
    query head forward, twice that backward; ``Lq(Lq+1)/2`` pairs for a causal call with ``Lq = Lk``."""
    for table, factor in ((_SDPA_FORWARD, 1), (_SDPA_BACKWARD, 2)):
        if name in table:
            causal_at = table[name]
            q, k = (args[1], args[2]) if factor == 2 else (args[0], args[1])
            is_causal = args[causal_at] if len(args) > causal_at else kwargs.get("is_causal", False)
            b, h, lq, d = q.shape
            lk = k.shape[2]
            pairs = causal_pairs(lq) if bool(is_causal) and lq == lk else lq * lk
            return factor * 4 * b * h * d * pairs
    return 0


class AttentionCounter(TorchDispatchMode):
    """Attention FLOPs of the fused SDPA kernels that run under it, counting the pairs each call computes:
    ``Lq(Lq+1)/2`` for a causal call with ``Lq = Lk``, ``Lq·Lk`` otherwise (a masked call computes every
    pair); ``4·hd`` per pair and query head forward, twice that backward (as FlopCounterMode)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.flops += attention_flops(name, args, kwargs)
        self.calls += name in _SDPA_FORWARD
        return func(*args, **kwargs)


class KernelCounter(TorchDispatchMode):
    """FLOPs of the convolutions and triangular solves that run under it.

    - ``convolution``: ``2·batch·C_out·(C_in/groups)·prod(kernel)·prod(output)`` forward (FlopCounterMode's
      count), the same again for each of the input and weight gradients ``convolution_backward`` computes;
    - ``linalg_solve_triangular`` of an ``n x n`` triangle against ``k`` right-hand sides: ``n(n-1)·k``
      (one multiply-add per strictly-lower entry and column), plus ``n·k`` divisions unless unitriangular.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv = 0
        self.solve = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        out = func(*args, **kwargs)
        if name in ("convolution", "convolution_backward"):
            self.conv += kernel_flops(name, args, kwargs, out)
        elif name == "linalg_solve_triangular":
            self.solve += kernel_flops(name, args, kwargs, out)
        return out


def _conv(out_shape, weight_shape) -> int:
    batch, c_out, *spatial = out_shape
    return 2 * batch * c_out * math.prod(weight_shape[1:]) * math.prod(spatial)


def kernel_flops(name: str, args, kwargs, out) -> int:
    """FLOPs of one convolution (forward or backward) or triangular solve (:class:`KernelCounter`'s rules);
    0 for any other op."""
    if name == "convolution":
        return _conv(out.shape, args[1].shape)
    if name == "convolution_backward":
        grad_out, weight, mask = args[0], args[2], args[10]
        return (int(mask[0]) + int(mask[1])) * _conv(grad_out.shape, weight.shape)
    if name == "linalg_solve_triangular":
        a, b = args[0], args[1]
        left = kwargs.get("left", args[3] if len(args) > 3 else True)
        unit = kwargs.get("unitriangular", args[4] if len(args) > 4 else False)
        n = a.shape[-1]
        rhs = b.numel() // (b.shape[-2] if left else b.shape[-1])
        return rhs * (n * (n - 1) + (0 if unit else n))
    return 0


def matmul_flops(func, args, kwargs, out) -> int:
    """FLOPs of one GEMM or batched matmul by torch's ``flop_registry`` formula; 0 for any other op."""
    packet = func.overloadpacket
    if packet.__name__ in (*GEMM_OPS, *BATCHED_OPS):
        return int(flop_registry[packet](*args, **kwargs, out_val=out))
    return 0


def op_flops(func, args, kwargs, out) -> int:
    """The FLOPs this module counts for one op call: a matmul's, an SDPA call's, a convolution's or a
    triangular solve's (pointwise ops, reductions and copies count 0)."""
    name = func.overloadpacket.__name__
    return (
        matmul_flops(func, args, kwargs, out)
        + attention_flops(name, args, kwargs)
        + kernel_flops(name, args, kwargs, out)
    )


def count_flops(fn: Callable[[], object]) -> tuple[Flops, object]:
    """Run ``fn()`` under :class:`MatmulCounter`, :class:`AttentionCounter` and :class:`KernelCounter`; return the
    counted FLOPs (``gemm``: mm/addmm; ``attention``: the SDPA pairs; ``recurrent``: bmm/baddbmm,
    convolutions and triangular solves) and ``fn``'s result."""
    ops, result = count_ops(fn)
    return Flops(ops["mm"], ops["sdpa"], ops["bmm"] + ops["conv"] + ops["solve"]), result


def count_ops(fn: Callable[[], object]) -> tuple[dict[str, int], object]:
    """:func:`count_flops` by op: ``{"mm", "bmm", "conv", "solve", "sdpa"}`` (``mm`` includes addmm, ``bmm``
    baddbmm)."""
    matmuls, attention, kernels = MatmulCounter(), AttentionCounter(), KernelCounter()
    with matmuls, attention, kernels:
        result = fn()
    per_op = matmuls.counts
    ops = {
        "mm": sum(per_op.get(op, 0) for op in GEMM_OPS),
        "bmm": sum(per_op.get(op, 0) for op in BATCHED_OPS),
        "conv": kernels.conv,
        "solve": kernels.solve,
        "sdpa": attention.flops,
    }
    return ops, result
