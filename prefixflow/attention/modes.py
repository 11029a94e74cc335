"""The SDPA-boundary wrapper and the attention modes the schedule switches between.

TorchTitan's attention modules call ``self.inner_attention(q, k, v, scale=..., enable_gqa=...)`` with
post-RoPE (and post qk-norm) ``[B, H, L, D]`` tensors. ``PrefixAwareAttention`` replaces that inner module.
With no mode set it calls the original module unchanged, so ``model(tokens)`` stays the plain
full-sequence forward. The schedule installs one of three modes for the duration of a phase:

- ``CapturePrefix``  (Phase A): keep each layer's prefix K/V in the cache, attend causally as usual.
- ``AttendWithPrefix`` (Phase B): suffix queries attend to ``[cached prefix K/V ; suffix K/V]`` under the
  layout's mask (every prefix key, own suffix causally, never another suffix or a pad).
- ``MaskedAttention`` (baseline, packed layout): plain attention under a block-diagonal causal mask.

When a microbatch's tokens are spread over ranks (context parallelism, ``Microbatch.sequence``), every mode
first gathers the whole sequence's K/V (``sequence.gather``) and attends this rank's queries to them under
the mask's local rows; the cached prefix view comes from the cache's ``PrefixView`` either way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from ..state.kv_cache import PrefixKVCache
from .split import split_attention, suffix_bias

__all__ = [
    "AttentionState",
    "PrefixAwareAttention",
    "CapturePrefix",
    "PrefixCaptured",
    "AttendWithPrefix",
    "MaskedAttention",
    "AttendWithAncestors",
    "ATTENTION_VARIANTS",
    "sdpa_backends",
]

ATTENTION_VARIANTS = ("concat", "split")


def _whole_sequence(sequence, k: torch.Tensor, v: torch.Tensor):
    """The K/V of every token of the microbatch: this rank's own, or gathered when tokens are sharded."""
    return (k, v) if sequence is None else sequence.gather(k, v)


class AttentionState:
    """Shared by all wrapped layers of one model: the mode of the phase that is running (or None)."""

    def __init__(self) -> None:
        self.mode = None
        self.wrappers: list[PrefixAwareAttention] = []
        self.state_layers: list = []  # recurrent layers' StatefulLayer (prefixflow.state.layers)

    @contextlib.contextmanager
    def use(self, mode) -> Iterator[None]:
        """Activate ``mode``; a mode with ``bind(wrappers)`` may hand each layer its data before the phase.
        Every bound ``prefix_kv`` is dropped on exit, then ``mode.unbind()`` runs if it has one."""
        if self.mode is not None:
            raise RuntimeError(
                f"attention mode {type(self.mode).__name__} is already active (nested phases?)"
            )
        self.mode = mode
        try:
            if hasattr(mode, "bind"):
                mode.bind(self.wrappers)
            yield
        finally:
            self.mode = None
            for wrapper in self.wrappers:
                wrapper.__dict__["prefix_kv"] = None  # a plain attribute (nn.Module.__setattr__ is slow)
            if hasattr(mode, "unbind"):
                mode.unbind()


class PrefixAwareAttention(nn.Module):
    """Wraps TorchTitan's SDPA module of one layer; dispatches to the active mode."""

    def __init__(self, inner: nn.Module, layer: int, state: AttentionState) -> None:
        super().__init__()
        self.inner = inner
        self.layer = layer
        self.state = state
        # This layer's cached prefix K/V while Phase B runs (set by AttendWithPrefix.bind). Read as a module
        # attribute, a compiled block gets it as a graph input: one graph serves every layer, where a
        # lookup by the integer ``layer`` would specialise (and recompile) the block per layer.
        self.prefix_kv = None
        state.wrappers.append(self)

    def forward(self, q, k, v, *, scale=None, enable_gqa: bool = False, is_causal: bool = True):
        mode = self.state.mode
        if mode is None:
            return self.inner(q, k, v, scale=scale, enable_gqa=enable_gqa, is_causal=is_causal)
        return mode(self, q, k, v, scale=scale, enable_gqa=enable_gqa)


class PrefixCaptured(Exception):
    """Raised once the last layer's prefix K/V are captured: nothing after them is ever needed."""


class CapturePrefix:
    """Phase A: record the live prefix K/V of every layer, then attend exactly as the plain model does.

    ``stop_after``: a layer index; after capturing it, raise :class:`PrefixCaptured` instead of attending. The
    prefix's outputs are never read (the loss lives on suffix tokens), so the last layer's attention output and
    MLP over the prefix are dead work: the baseline computes them in every sequence, PrefixFlow skips them.
    """

    def __init__(
        self,
        cache: PrefixKVCache,
        stop_after: int | None = None,
        *,
        mask: torch.Tensor | None = None,
        sequence=None,
    ) -> None:
        self.cache = cache
        self.stop_after = stop_after
        self.mask = mask  # None: plain causal over the whole prefix
        self.sequence = sequence  # the prefix's sequence exchange when its tokens are sharded

    def __call__(self, wrapper: PrefixAwareAttention, q, k, v, *, scale, enable_gqa):
        self.cache.capture(wrapper.layer, k, v)
        if wrapper.layer == self.stop_after:
            raise PrefixCaptured
        if self.mask is None and self.sequence is None:
            return wrapper.inner(q, k, v, scale=scale, enable_gqa=enable_gqa, is_causal=True)
        k, v = _whole_sequence(self.sequence, k, v)
        return _masked_sdpa(wrapper, q, k, v, self.mask, scale, enable_gqa)


def sdpa_backends(wrapper: PrefixAwareAttention) -> list | None:
    """The ``sdpa_kernel`` backend list of the layer's own attention module (TorchTitan's
    ``ScaledDotProductAttentionWrapper.sdpa_backends``), or None when it sets none."""
    backends = getattr(wrapper.inner, "sdpa_backends", None)
    return list(backends) if backends else None


def _masked_sdpa(wrapper: PrefixAwareAttention, q, k, v, mask, scale, enable_gqa):
    """SDPA under an explicit mask, restricted to the same backend list as the model's own attention, so a
    masked call runs the kernels the plain (causal) call is allowed to run."""
    backends = sdpa_backends(wrapper)
    scope = sdpa_kernel(backends, set_priority=True) if backends else contextlib.nullcontext()
    with scope:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


class AttendWithPrefix:
    """Phase B: suffix queries attend to the cached prefix K/V and their own K/V.

    ``mask``: bool ``[b, 1, S, P_c + S]`` (True = may attend) from the suffix layout. ``causal_suffix``: the
    layout guarantees that plain causal attention over the suffix columns is exact on every row that matters
    (the padded layout, tokens not sharded), so split attention runs its suffix part with ``is_causal`` and
    no mask. ``variant="concat"`` runs one masked SDPA over ``[prefix ; suffix]`` K/V: ``torch.cat``
    materialises the cached prefix K/V once per sequence of the microbatch, in every layer, and the masked
    kernel computes every (query, key) pair including the suffix's causal upper triangle. ``"split"`` reads
    the cache in place (:mod:`prefixflow.attention.split`) and needs at most the mask's suffix columns. Both
    run under the model's ``sdpa_kernel`` backend list (:func:`sdpa_backends`).
    """

    def __init__(
        self,
        cache: PrefixKVCache,
        mask: torch.Tensor,
        variant: str = "concat",
        *,
        sequence=None,
        causal_suffix: bool = False,
    ) -> None:
        if variant not in ATTENTION_VARIANTS:
            raise ValueError(f"attention variant {variant!r} unknown; valid: {ATTENTION_VARIANTS}")
        self.cache = cache
        self.mask = mask
        self.variant = variant
        self.sequence = sequence  # the microbatch's sequence exchange when its tokens are sharded
        self._suffix_mask = self._split_mask = None
        if variant == "split" and len(cache):
            n_keys = mask.shape[-2] if sequence is None else sequence.length
            causal = causal_suffix and sequence is None
            self._suffix_mask = None if causal else mask[..., mask.shape[-1] - n_keys :]
            # Built once per microbatch, eagerly (it may inspect the mask), shared by every layer.
            self._split_mask = suffix_bias(self._suffix_mask, cache.compute_dtype, causal=causal)

    def bind(self, wrappers: list[PrefixAwareAttention]) -> None:
        """Give each wrapped layer its prefix K/V view (in the compute dtype) for this phase; a lazy
        :class:`~prefixflow.state.kv_cache.PrefixView` is read by each layer when its attention runs instead."""
        if not len(self.cache):
            return
        self.cache.view.begin(self.cache)
        if not self.cache.view.lazy:
            for wrapper in wrappers:
                wrapper.__dict__["prefix_kv"] = self.cache.read(wrapper.layer, self.cache.compute_dtype)

    def unbind(self) -> None:
        if len(self.cache):
            self.cache.view.end()

    def __call__(self, wrapper: PrefixAwareAttention, q, k, v, *, scale, enable_gqa):
        cached = wrapper.prefix_kv  # set by bind() when AttentionState.use activated this mode
        if cached is None and self.cache.view.lazy and len(self.cache):
            cached = self.cache.read(wrapper.layer, self.cache.compute_dtype)
        k, v = _whole_sequence(self.sequence, k, v)
        if cached is not None and self.variant == "split":
            return split_attention(
                q, k, v, *cached, self._suffix_mask, scale=scale, prepared=self._split_mask,
                backends=sdpa_backends(wrapper),
            )  # fmt: skip
        if cached is not None:
            prefix_k, prefix_v = cached
            b = q.shape[0]
            k = torch.cat([prefix_k.expand(b, -1, -1, -1), k], dim=2)  # b copies of the prefix K/V
            v = torch.cat([prefix_v.expand(b, -1, -1, -1), v], dim=2)
        return _masked_sdpa(wrapper, q, k, v, self.mask, scale, enable_gqa)


class MaskedAttention:
    """Plain attention under an explicit mask (the baseline's packed layout; under the model's backend list);
    with neither a mask nor a sequence exchange it is the wrapped module's own causal attention."""

    def __init__(self, mask: torch.Tensor, sequence=None) -> None:
        self.mask = mask
        self.sequence = sequence  # the microbatch's sequence exchange when its tokens are sharded

    def __call__(self, wrapper: PrefixAwareAttention, q, k, v, *, scale, enable_gqa):
        if self.mask is None and self.sequence is None:
            return wrapper.inner(q, k, v, scale=scale, enable_gqa=enable_gqa, is_causal=True)
        k, v = _whole_sequence(self.sequence, k, v)
        return _masked_sdpa(wrapper, q, k, v, self.mask, scale, enable_gqa)


class AttendWithAncestors:
    """Prefix trees: queries attend to the cached K/V of their ancestor nodes and to their own K/V.

    ``read(layer, dtype)``: the K/V of the nodes this microbatch reads, concatenated along the keys
    (``[1, H_kv, U, D]``, differentiable w.r.t. each node's leaves), or None when it reads none. ``mask``: bool
    ``[b, 1, L, U + L]`` (None: no keys before the tokens, plain causal). ``capture``: a node's
    :class:`~prefixflow.state.kv_cache.PrefixKVCache` that keeps this forward's live K/V (Phase A); None in Phase B
    and when a checkpointed node block recomputes in Phase C. ``sequence``: the microbatch's sequence
    exchange when its tokens are spread over ranks (the mask then has this rank's query rows; a node captures
    its own K/V shard). ``read`` may have ``begin()``/``end()``, called around the phase's forward, and
    ``states(layer, parents)`` (recurrent layers: each row's parent node's end state). ``rows``: the
    microbatch's tree rows (``Microbatch.tree_rows``), in row/packing order.
    """

    def __init__(
        self,
        read,
        mask: torch.Tensor | None,
        capture: PrefixKVCache | None = None,
        *,
        sequence=None,
        rows: tuple = (),
    ) -> None:
        self.read, self.mask, self.capture, self.sequence = read, mask, capture, sequence
        self.rows = rows

    def bind(self, wrappers: list[PrefixAwareAttention]) -> None:
        if hasattr(self.read, "begin"):
            self.read.begin()

    def unbind(self) -> None:
        if hasattr(self.read, "end"):
            self.read.end()

    def __call__(self, wrapper: PrefixAwareAttention, q, k, v, *, scale, enable_gqa):
        if self.capture is not None:
            self.capture.capture(wrapper.layer, k, v)
        cached = self.read(wrapper.layer, k.dtype)
        if cached is None and self.mask is None and self.sequence is None:
            return wrapper.inner(q, k, v, scale=scale, enable_gqa=enable_gqa, is_causal=True)
        k, v = _whole_sequence(self.sequence, k, v)
        if cached is not None:
            b = q.shape[0]
            k = torch.cat([cached[0].expand(b, -1, -1, -1), k], dim=2)
            v = torch.cat([cached[1].expand(b, -1, -1, -1), v], dim=2)
        return _masked_sdpa(wrapper, q, k, v, self.mask, scale, enable_gqa)
