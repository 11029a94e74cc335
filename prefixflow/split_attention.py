"""Suffix attention that reads the cached prefix K/V in place (PrefixFlow's ``attention="split"`` variant).

The ``"concat"`` variant builds ``[prefix ; suffix]`` K/V (a copy of the whole cached prefix per layer and
microbatch) and runs one masked SDPA. This module computes the same attention in two parts and merges them
with their log-sum-exp, so the cached prefix is only *read*:

- prefix part: suffix queries against the cached prefix K/V, no mask (every suffix query sees every prefix
  key). The prefix is shared by the whole microbatch, so the ``b`` suffix rows are folded into the query
  length (``[b, H, S, D] -> [1, H, b*S, D]``, free for ``b == 1``) and one attention runs against the
  ``[1, H_kv, P, D]`` cache: no ``expand`` over the batch and a gK/gV of the cache's own shape.
- suffix part: suffix queries against suffix K/V under the layout's suffix mask (plain causal when the
  mask is exactly lower-triangular, which skips the mask entirely).
- merge: ``lse = logaddexp(lse_p, lse_s)``, ``o = o_p * exp(lse_p - lse) + o_s * exp(lse_s - lse)``.

The backward is the ring-attention identity: each part's backward, run with the *merged* output and
log-sum-exp, gives that part's exact gradients (``dS = P * (dP - rowsum(dO * O))`` with ``P`` normalised by the
merged ``lse``). On CPU both parts and their backward are ATen's flash-attention kernels
(``_scaled_dot_product_flash_attention_for_cpu[_backward]``, which return the log-sum-exp and handle
GQA head grouping themselves, so no K/V head ``repeat``); on other devices a differentiable reference in
plain PyTorch ops (:func:`split_attention_reference`) is used.
"""

from __future__ import annotations

import math

import torch

__all__ = ["split_attention", "split_attention_reference", "suffix_bias"]

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_CPU_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def suffix_bias(suffix_mask: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor | None, bool]:
    """The suffix part's mask as the flash kernel wants it: ``(additive bias or None, is_causal)``.

    ``suffix_mask``: bool ``[b, 1, S_q, S]`` (True = may attend) or None (plain causal). An exactly
    lower-triangular mask (padded layout with equal lengths, e.g. microbatch 1) becomes ``is_causal=True``.
    """
    if suffix_mask is None:
        return None, True
    s = suffix_mask.shape[-1]
    if suffix_mask.shape[-2] == s:  # a query block over other keys (sequence-sharded) is never plain causal
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


class _SplitAttentionCPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, prefix_k, prefix_v, bias, is_causal, scale):
        b = q.shape[0]
        qf = _fold(q)
        out_p, lse_p = _FLASH_CPU(qf, prefix_k, prefix_v, 0.0, False, scale=scale)
        out_s, lse_s = _FLASH_CPU(q, k, v, 0.0, is_causal, attn_mask=bias, scale=scale)
        out_p, lse_p = _unfold(out_p, b), _unfold(lse_p, b)
        lse = torch.logaddexp(lse_p, lse_s)
        acc = torch.promote_types(lse.dtype, q.dtype)
        w_p = torch.exp(lse_p - lse).unsqueeze(-1).to(acc)
        w_s = torch.exp(lse_s - lse).unsqueeze(-1).to(acc)
        out = (out_p.to(acc) * w_p + out_s.to(acc) * w_s).to(q.dtype)
        ctx.save_for_backward(q, k, v, prefix_k, prefix_v, bias, out, lse)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, prefix_k, prefix_v, bias, out, lse = ctx.saved_tensors
        b = q.shape[0]
        grad_out = grad_out.contiguous()
        gq_p, gk_p, gv_p = _FLASH_CPU_BWD(
            _fold(grad_out), _fold(q), prefix_k, prefix_v, _fold(out), _fold(lse), 0.0, False, scale=ctx.scale
        )
        gq_s, gk_s, gv_s = _FLASH_CPU_BWD(
            grad_out, q, k, v, out, lse, 0.0, ctx.is_causal, attn_mask=bias, scale=ctx.scale
        )
        return gq_s + _unfold(gq_p, b), gk_s, gv_s, gk_p, gv_p, None, None, None


def _flash_cpu_ok(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" for t in tensors) and tensors[0].dtype in (
        torch.float32,
        torch.float64,
        torch.bfloat16,
        torch.float16,
    )


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
) -> torch.Tensor:
    """Attention of suffix queries over ``[prefix ; suffix]`` keys without concatenating them.

    ``q``: ``[b, H, S, D]``; ``k``/``v``: ``[b, H_kv, S, D]``; ``prefix_k``/``prefix_v``: ``[1, H_kv, P, D]``
    (shared by the batch); ``suffix_mask``: bool ``[b, 1, S, S]`` over the suffix keys (None = causal);
    every prefix key is visible to every query. Differentiable w.r.t. ``q, k, v, prefix_k, prefix_v``.
    ``prepared``: ``suffix_bias(suffix_mask, q.dtype)`` computed once and shared by every layer.
    Equals ``sdpa(q, cat(prefix_k.expand(b), k), ..., mask=cat(ones, suffix_mask), enable_gqa=True)``.
    """
    if prefix_k.shape[0] != 1 or prefix_v.shape[0] != 1:
        raise ValueError(
            f"prefix K/V must have batch size 1 (shared by the microbatch), got {tuple(prefix_k.shape)}"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if _flash_cpu_ok(q, k, v, prefix_k, prefix_v):
        bias, is_causal = prepared if prepared is not None else suffix_bias(suffix_mask, q.dtype)
        return _SplitAttentionCPU.apply(q, k, v, prefix_k, prefix_v, bias, is_causal, scale)
    return split_attention_reference(q, k, v, prefix_k, prefix_v, suffix_mask, scale=scale)


def _attend_lse(q, k, v, mask, scale):
    """Grouped-query attention in plain ops: ``(out, lse)``; ``q [B, H_kv, R, S, D]``, ``k/v [B, H_kv, L, D]``."""
    scores = torch.einsum("bgrsd,bgld->bgrsl", q, k) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bgrsl,bgld->bgrsd", torch.exp(scores - lse.unsqueeze(-1)), v)
    return out, lse


def split_attention_reference(q, k, v, prefix_k, prefix_v, suffix_mask, *, scale: float | None = None):
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
    out_p, lse_p = _attend_lse(qp, prefix_k.to(compute), prefix_v.to(compute), None, scale)
    out_p = out_p.view(h_kv, h // h_kv, b, s, d).permute(2, 0, 1, 3, 4)
    lse_p = lse_p.view(h_kv, h // h_kv, b, s).permute(2, 0, 1, 3)
    if suffix_mask is None:
        suffix_mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril_().view(1, 1, s, s)
    mask = suffix_mask.unsqueeze(2)  # [b or 1, 1, 1, S, S] over (H_kv, n_rep)
    out_s, lse_s = _attend_lse(qg, k.to(compute), v.to(compute), mask, scale)
    lse = torch.logaddexp(lse_p, lse_s)
    out = out_p * torch.exp(lse_p - lse).unsqueeze(-1) + out_s * torch.exp(lse_s - lse).unsqueeze(-1)
    return out.reshape(b, h, s, d).to(q.dtype)
