"""Suffix attention that reads the cached prefix K/V in place (PrefixFlow's ``attention="split"`` variant).

The ``"concat"`` variant builds ``[prefix ; suffix]`` K/V (a copy of the whole cached prefix per sequence, layer
and microbatch) and runs one masked SDPA. This module computes the same attention in two parts and merges them
with their log-sum-exp, so the cached prefix is only *read*:

- prefix part: suffix queries against the cached prefix K/V, no mask when every suffix query sees every
  prefix key (else under a bias from the rows' key mask: a tree microbatch whose rows read different
  ancestors). The prefix is shared by the whole microbatch, so the ``b`` suffix rows are folded into the
  query length (``[b, H, S, D] -> [1, H, b*S, D]``, free for ``b == 1``) and one attention runs against the
  ``[1, H_kv, P, D]`` cache: no ``expand`` over the batch and a gK/gV of the cache's own shape.
- suffix part: suffix queries against suffix K/V, plain causal (no mask at all) when the layout allows it,
  else under an additive bias built from the layout's suffix mask.
- merge: ``lse = logaddexp(lse_p, lse_s)``, ``o = o_p * exp(lse_p - lse) + o_s * exp(lse_s - lse)``.

The backward is the ring-attention identity: each part's backward, run with the *merged* output and
log-sum-exp, gives that part's exact gradients (``dS = P * (dP - rowsum(dO * O))`` with ``P`` normalised by the
merged ``lse``). Fused kernels that return the log-sum-exp (:class:`_Kernel`):

- CPU: ATen's ``_scaled_dot_product_flash_attention_for_cpu[_backward]`` (any float dtype, a bias, GQA);
- CUDA: ``_scaled_dot_product_flash_attention[_backward]`` (fp16/bf16, no bias; GQA native when SDPA would
  route it there, else heads expanded) or ``_scaled_dot_product_efficient_attention[_backward]`` with
  ``compute_log_sumexp`` (any float dtype, a bias; heads expanded), picked in the order of the allowed
  ``backends`` (the model's ``sdpa_kernel`` list, so both systems run the same kernels).

Anything else (another device, an unsupported shape or dtype, or no allowed fused backend) uses
:func:`split_attention_reference`, a differentiable version in plain PyTorch ops.
"""

from __future__ import annotations

import math

import torch
from torch.nn.attention import SDPBackend

from ..schedule.host import has_values

__all__ = ["split_attention", "split_attention_reference", "suffix_bias"]

_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_aten = torch.ops.aten


def suffix_bias(
    suffix_mask: torch.Tensor | None, dtype: torch.dtype, causal: bool = False
) -> tuple[torch.Tensor | None, bool]:
    """The suffix part's mask as the kernels want it: ``(additive bias or None, is_causal)``.

    ``suffix_mask``: bool ``[b, 1, S_q, S]`` (True = may attend) or None (plain causal). An exactly
    lower-triangular mask becomes ``is_causal=True``. ``causal=True``: the caller knows that plain causal
    attention gives the same result on every row that matters (the padded layout: a real query's visible
    keys are exactly its causal predecessors; pad rows carry no loss and no real query reads them), so the
    mask is neither inspected nor turned into a bias.
    """
    if causal or suffix_mask is None:
        return None, True
    s = suffix_mask.shape[-1]
    # A fake mask (an estimate) cannot be inspected: the layout already said causal where it is (causal_suffix).
    if suffix_mask.shape[-2] == s and has_values(suffix_mask):  # a sequence-sharded query block never is
        tril = torch.ones(s, s, dtype=torch.bool, device=suffix_mask.device).tril_()
        if torch.equal(suffix_mask, tril.expand_as(suffix_mask)):
            return None, True
    bias = torch.zeros(suffix_mask.shape, dtype=dtype, device=suffix_mask.device)
    return bias.masked_fill_(~suffix_mask, float("-inf")), False


def _fold(x: torch.Tensor) -> torch.Tensor:
    """``[b, H, S, ...] -> [1, H, b*S, ...]`` (a view when ``b == 1``)."""
    b, h, s = x.shape[:3]
    if b == 1:
        return x
    return x.transpose(0, 1).reshape(1, h, b * s, *x.shape[3:])


def _unfold(x: torch.Tensor, b: int) -> torch.Tensor:
    """Inverse of :func:`_fold` for ``[1, H, b*S, ...]``."""
    if b == 1:
        return x
    h, bs = x.shape[1], x.shape[2]
    return x.reshape(h, b, bs // b, *x.shape[3:]).transpose(0, 1)


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA K/V ``[B, H_kv, L, D] -> [B, H, L, D]`` (query head ``i`` reads KV head ``i // (H / H_kv)``)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _reduce_heads(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of :func:`_expand_heads`: sum each KV head's query-head group."""
    b, h, length, d = g.shape
    return g if h == kv_heads else g.view(b, kv_heads, h // kv_heads, length, d).sum(2)


class _Kernel:
    """One fused attention kernel that returns the log-sum-exp: ``forward`` -> ``(out, lse, state)``,
    ``backward`` (with the merged out and lse) -> ``(dq, dk, dv)``. ``lse`` is ``[B, H, Lq]`` in the kernel's
    accumulation dtype (fp32; fp64 for fp64 inputs on CPU)."""

    expands_heads = False

    def forward(self, q, k, v, bias, is_causal, scale):
        raise NotImplementedError

    def backward(self, grad_out, q, k, v, bias, out, lse, is_causal, scale, state):
        raise NotImplementedError


class _FlashCPU(_Kernel):
    def forward(self, q, k, v, bias, is_causal, scale):
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=bias, scale=scale
        )
        return out, lse, None

    def backward(self, grad_out, q, k, v, bias, out, lse, is_causal, scale, state):
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, is_causal, attn_mask=bias, scale=scale
        )


class _FlashCUDA(_Kernel):
    """``aten._scaled_dot_product_flash_attention``: no bias; returns ``(out, lse, cum_seq_q, cum_seq_k,
    max_q, max_k, rng_state, unused, debug_mask)``, and its backward takes them back (dropout 0)."""

    def __init__(self, expands_heads: bool) -> None:
        self.expands_heads = expands_heads

    def forward(self, q, k, v, bias, is_causal, scale):
        out, lse, cum_q, cum_k, max_q, max_k, rng, unused, _ = _aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, is_causal, False, scale=scale
        )
        return out, lse[..., : q.shape[2]], (cum_q, cum_k, max_q, max_k, rng, unused)

    def backward(self, grad_out, q, k, v, bias, out, lse, is_causal, scale, state):
        cum_q, cum_k, max_q, max_k, rng, unused = state
        return _aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse.contiguous(), cum_q, cum_k, max_q, max_k, 0.0, is_causal, rng,
            unused, scale=scale,
        )  # fmt: skip


class _EfficientCUDA(_Kernel):
    """``aten._scaled_dot_product_efficient_attention`` with ``compute_log_sumexp``: its lse rows are padded
    to a multiple of 32, and its backward wants that layout back. A bias is padded to a 16-element aligned
    row and broadcast, as SDPA's own dispatch does."""

    expands_heads = True
    LSE_ALIGN = 32
    BIAS_ALIGN = 16

    def _bias(self, bias, q, k):
        if bias is None:
            return None
        lk = k.shape[2]
        pad = (-lk) % self.BIAS_ALIGN
        if pad:
            bias = torch.nn.functional.pad(bias, (0, pad))[..., :lk]
        return bias.expand(q.shape[0], q.shape[1], q.shape[2], lk)

    def forward(self, q, k, v, bias, is_causal, scale):
        out, lse, seed, offset = _aten._scaled_dot_product_efficient_attention(
            q, k, v, self._bias(bias, q, k), True, 0.0, is_causal, scale=scale
        )
        return out, lse[..., : q.shape[2]], (seed, offset, lse.shape[-1])

    def backward(self, grad_out, q, k, v, bias, out, lse, is_causal, scale, state):
        seed, offset, padded = state
        lse_padded = lse.new_zeros(*lse.shape[:-1], padded)
        lse_padded[..., : lse.shape[-1]] = lse
        gq, gk, gv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v, self._bias(bias, q, k), out, lse_padded, seed, offset, 0.0,
            [True, True, True, False], is_causal, scale=scale,
        )  # fmt: skip
        return gq, gk, gv


_KERNELS: dict[str, _Kernel] = {
    "flash_cpu": _FlashCPU(),
    "flash_cuda": _FlashCUDA(expands_heads=False),
    "flash_cuda_expanded": _FlashCUDA(expands_heads=True),
    "efficient_cuda": _EfficientCUDA(),
}


def _cuda_kernel(q, k, bias, is_causal, backends) -> str | None:
    """The first fused CUDA kernel in ``backends`` order that accepts these inputs (None: use the reference)."""
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

    if q.shape[-1] % 8 or q.dtype not in _FLOATS:
        return None
    expanded = k[:, :1].expand(q.shape[0], q.shape[1], *k.shape[2:])  # K/V with the query heads (a view)
    order = backends or (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
    for backend in order:
        if (
            backend == SDPBackend.FLASH_ATTENTION
            and bias is None
            and q.dtype in (torch.float16, torch.bfloat16)
        ):
            if can_use_flash_attention(SDPAParams(q, k, k, None, 0.0, is_causal, q.shape[1] != k.shape[1])):
                return "flash_cuda"
            if can_use_flash_attention(SDPAParams(q, expanded, expanded, None, 0.0, is_causal, False)):
                return "flash_cuda_expanded"
        if backend == SDPBackend.EFFICIENT_ATTENTION:
            mask = None if bias is None else bias.expand(*q.shape[:3], k.shape[2])
            if can_use_efficient_attention(SDPAParams(q, expanded, expanded, mask, 0.0, is_causal, False)):
                return "efficient_cuda"
    return None


def _kernel_for(q, k, bias, is_causal, backends) -> str | None:
    """The fused kernel (a name in ``_KERNELS``) for one part, or None. Chosen eagerly: under torch.compile a
    CUDA kernel check cannot be traced, so compiled CUDA blocks use the reference (CPU always has its kernel)."""
    if q.dtype not in _FLOATS:
        return None
    if q.device.type == "cpu":
        return "flash_cpu"
    if q.device.type == "cuda" and not torch.compiler.is_compiling():
        return _cuda_kernel(q, k, bias, is_causal, backends)
    return None


def _attend(name: str, q, k, v, bias, is_causal, scale):
    kernel = _KERNELS[name]
    if kernel.expands_heads:
        k, v = _expand_heads(k, q.shape[1]), _expand_heads(v, q.shape[1])
    return kernel.forward(q, k, v, bias, is_causal, scale)


def _attend_backward(name: str, grad_out, q, k, v, bias, out, lse, is_causal, scale, state):
    kernel, kv_heads = _KERNELS[name], k.shape[1]
    if kernel.expands_heads:
        k, v = _expand_heads(k, q.shape[1]), _expand_heads(v, q.shape[1])
    gq, gk, gv = kernel.backward(grad_out, q, k, v, bias, out, lse, is_causal, scale, state)
    return gq, _reduce_heads(gk, kv_heads), _reduce_heads(gv, kv_heads)


class _SplitAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        prefix_k,
        prefix_v,
        bias,
        is_causal,
        scale,
        prefix_kernel,
        suffix_kernel,
        prefix_bias,
        dead,
    ):
        b = q.shape[0]
        qf = _fold(q)
        out_p, lse_p, state_p = _attend(prefix_kernel, qf, prefix_k, prefix_v, prefix_bias, False, scale)
        if dead is not None:  # queries that see no prefix key: the part is empty (the kernels' rows are not)
            out_p = out_p.masked_fill(dead.unsqueeze(-1), 0.0)
            lse_p = lse_p.masked_fill(dead, float("-inf"))
        out_s, lse_s, state_s = _attend(suffix_kernel, q, k, v, bias, is_causal, scale)
        out_p, lse_p = _unfold(out_p, b), _unfold(lse_p, b)
        lse = torch.logaddexp(lse_p, lse_s)  # the kernels' lse dtype: fp32, or fp64 for fp64 inputs
        acc = torch.promote_types(lse.dtype, q.dtype)
        w_p = torch.exp(lse_p - lse).unsqueeze(-1).to(acc)
        w_s = torch.exp(lse_s - lse).unsqueeze(-1).to(acc)
        out = (out_p.to(acc) * w_p + out_s.to(acc) * w_s).to(q.dtype)
        ctx.save_for_backward(q, k, v, prefix_k, prefix_v, bias, out, lse, prefix_bias)
        ctx.is_causal, ctx.scale = is_causal, scale
        ctx.kernels, ctx.states = (prefix_kernel, suffix_kernel), (state_p, state_s)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, prefix_k, prefix_v, bias, out, lse, prefix_bias = ctx.saved_tensors
        (prefix_kernel, suffix_kernel), (state_p, state_s) = ctx.kernels, ctx.states
        b = q.shape[0]
        grad_out = grad_out.contiguous()
        gq_p, gk_p, gv_p = _attend_backward(
            prefix_kernel, _fold(grad_out), _fold(q), prefix_k, prefix_v, prefix_bias, _fold(out),
            _fold(lse), False, ctx.scale, state_p,
        )  # fmt: skip
        gq_s, gk_s, gv_s = _attend_backward(
            suffix_kernel, grad_out, q, k, v, bias, out, lse, ctx.is_causal, ctx.scale, state_s
        )
        return gq_s + _unfold(gq_p, b), gk_s, gv_s, gk_p, gv_p, None, None, None, None, None, None, None


def split_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    suffix_mask: torch.Tensor | None,
    *,
    scale: float | None = None,
    prepared: tuple[torch.Tensor | None, bool] | None = None,
    keys_mask: torch.Tensor | None = None,
    backends: list[SDPBackend] | None = None,
) -> torch.Tensor:
    """Attention of suffix queries over ``[prefix ; suffix]`` keys without concatenating them.

    ``q``: ``[b, H, S, D]``; ``k``/``v``: ``[b, H_kv, S, D]``; ``prefix_k``/``prefix_v``: ``[1, H_kv, P, D]``
    (shared by the batch); ``suffix_mask``: bool ``[b, 1, S, S]`` over the suffix keys (None = causal);
    ``keys_mask``: bool ``[b, 1, S, P]`` over the prefix keys, None when every prefix key is visible to every
    query. Differentiable w.r.t. ``q, k, v, prefix_k, prefix_v``.
    ``prepared``: ``suffix_bias(...)`` computed once and shared by every layer. ``backends``: the fused CUDA
    kernels allowed, in priority order (the model's ``sdpa_kernel`` list; None = flash, then efficient).
    Equals ``sdpa(q, cat(prefix_k.expand(b), k), ..., mask=cat(keys_mask or ones, suffix_mask),
    enable_gqa=True)``.
    """
    if prefix_k.shape[0] != 1 or prefix_v.shape[0] != 1:
        raise ValueError(
            f"prefix K/V must have batch size 1 (shared by the microbatch), got {tuple(prefix_k.shape)}"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    bias, is_causal = prepared if prepared is not None else suffix_bias(suffix_mask, q.dtype)
    prefix_bias = dead = None
    if keys_mask is not None:
        folded = _fold(keys_mask.expand(q.shape[0], 1, *keys_mask.shape[2:]))  # [1, 1, b*S, P]
        prefix_bias = torch.zeros(folded.shape, dtype=q.dtype, device=q.device)
        prefix_bias.masked_fill_(~folded, float("-inf"))
        dead = ~folded.any(-1)  # [1, 1, b*S]: a row of a tree microbatch that reads no cached node
    same_device = all(t.device == q.device for t in (k, v, prefix_k, prefix_v))
    prefix_kernel = _kernel_for(_fold(q), prefix_k, prefix_bias, False, backends) if same_device else None
    suffix_kernel = _kernel_for(q, k, bias, is_causal, backends) if prefix_kernel is not None else None
    if suffix_kernel is None:
        return split_attention_reference(
            q, k, v, prefix_k, prefix_v, suffix_mask, scale=scale, keys_mask=keys_mask
        )
    return _SplitAttention.apply(
        q, k, v, prefix_k, prefix_v, bias, is_causal, scale, prefix_kernel, suffix_kernel, prefix_bias, dead
    )


def _attend_lse(q, k, v, mask, scale):
    """Grouped-query attention in plain ops: ``(out, lse)``; ``q [B, H_kv, R, S, D]``, ``k/v [B, H_kv, L, D]``.
    A fully masked row gives ``out = 0`` and ``lse = -inf`` (finite gradients), as the fused kernels do."""
    scores = torch.einsum("bgrsd,bgld->bgrsl", q, k) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # no -inf - -inf
    out = torch.einsum("bgrsl,bgld->bgrsd", torch.exp(scores - safe.unsqueeze(-1)), v)
    return out, lse


def _merge_weight(lse_part: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(lse_part - lse)``, 0 where the whole row is masked (``lse = -inf``)."""
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(lse_part - safe).unsqueeze(-1)


def split_attention_reference(
    q, k, v, prefix_k, prefix_v, suffix_mask, *, scale: float | None = None, keys_mask=None
):
    """:func:`split_attention` in differentiable plain PyTorch ops (any device/dtype; materialises scores).

    GQA without copies: queries are viewed as ``[b, H_kv, n_rep, S, D]`` against ``[.., H_kv, L, D]`` keys.
    """
    b, h, s, d = q.shape
    h_kv = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    compute = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(compute).view(b, h_kv, h // h_kv, s, d)
    # Prefix part: fold the batch into the query length, attend to the one shared cache.
    qp = qg.permute(1, 2, 0, 3, 4).reshape(1, h_kv, h // h_kv, b * s, d)
    fold = None
    if keys_mask is not None:  # [b or 1, 1, S, P] -> [1, 1, 1, b*S, P], the queries' folded order
        fold = keys_mask.expand(b, 1, s, keys_mask.shape[-1]).permute(1, 0, 2, 3).reshape(1, 1, 1, b * s, -1)
    out_p, lse_p = _attend_lse(qp, prefix_k.to(compute), prefix_v.to(compute), fold, scale)
    out_p = out_p.view(h_kv, h // h_kv, b, s, d).permute(2, 0, 1, 3, 4)
    lse_p = lse_p.view(h_kv, h // h_kv, b, s).permute(2, 0, 1, 3)
    if suffix_mask is None:
        suffix_mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril_().view(1, 1, s, s)
    mask = suffix_mask.unsqueeze(2)  # [b or 1, 1, 1, S, S] over (H_kv, n_rep)
    out_s, lse_s = _attend_lse(qg, k.to(compute), v.to(compute), mask, scale)
    lse = torch.logaddexp(lse_p, lse_s)
    out = out_p * _merge_weight(lse_p, lse) + out_s * _merge_weight(lse_s, lse)
    return out.reshape(b, h, s, d).to(q.dtype)
