"""The SDPA-boundary wrapper and the attention modes the schedule switches between.

TorchTitan's attention modules call ``self.inner_attention(q, k, v, scale=..., enable_gqa=...)`` with
post-RoPE (and post qk-norm) ``[B, H, L, D]`` tensors. ``PrefixAwareAttention`` replaces that inner module.
With no mode set it calls the original module unchanged, so ``model(tokens)`` stays the plain
full-sequence forward. The schedule installs a mode for the duration of each forward:

- ``NodeAttention`` (every PrefixFlow phase): the rows attend to the cached K/V of the nodes they read and to
  their own K/V under the layout's mask; in Phase A a node's forward also captures its live K/V.
- ``MaskedAttention`` (baseline, packed layout): plain attention under a block-diagonal causal mask.

When a microbatch's tokens are spread over ranks (context parallelism, ``Microbatch.sequence``), every mode
first gathers the whole sequence's K/V (``sequence.gather``) and attends this rank's queries to them under
the mask's local rows; a cached node's K/V come from its cache's ``PrefixView`` either way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from .split import split_attention, suffix_bias

__all__ = [
    "AttentionState",
    "PrefixAwareAttention",
    "PrefixCaptured",
    "NodeAttention",
    "MaskedAttention",
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
        # This layer's cached K/V while a forward reads them (set by NodeAttention.bind). Read as a module
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
    """Raised once a node's last layer has captured its K/V: nothing after them is ever needed."""


class NodeAttention:
    """Every phase's attention: queries attend to the cached K/V of the nodes their rows read and to their own
    K/V, under the layout's mask (every key of the row's ancestors, its own tokens causally, never another
    row's, never a pad).

    - ``keys``: the cached K/V the microbatch reads (``keys(layer, dtype)`` -> ``(k, v)`` ``[1, H_kv, U, D]``,
      differentiable w.r.t. each node's leaves, or None when it reads none); it may have ``begin()``/``end()``
      (around the forward), ``lazy`` (read when each layer runs, e.g. a gathering view; else every layer's
      view is bound once per microbatch, so a compiled block gets it as a graph input) and
      ``states(layer, parents)`` (recurrent layers: each row's parent node's end state).
    - ``mask``: bool ``[b, 1, L, U + L]`` (None: no keys before the tokens, plain causal); ``rows``: the
      microbatch's rows (``Microbatch.rows``); ``sequence``: the microbatch's sequence exchange when its tokens
      are spread over ranks (the mask then has this rank's query rows; a node captures its own K/V shard).
    - ``capture``: a node's cache that keeps this forward's live K/V (Phase A), None otherwise (Phase B, and a
      checkpointed block recomputing in Phase C). ``stop_after``: after capturing that layer, raise
      :class:`PrefixCaptured` (nothing the node scores needs its last layer's output).
    - ``variant``: ``"concat"`` runs one masked SDPA over ``[cached ; own]`` K/V (``torch.cat`` copies the
      cached K/V once per row, in every layer, and the masked kernel computes every pair); ``"split"`` reads
      the cache in place (:mod:`prefixflow.attention.split`): a pass over the cached keys (maskless when every
      row sees every key, ``keys_visible``) and one over the own keys (plain causal when ``causal_own``: the
      padded layout, tokens not sharded), merged by log-sum-exp. Both run under the model's ``sdpa_kernel``
      backend list (:func:`sdpa_backends`).
    - ``layer_masks``: per layer index, a mask that replaces ``mask`` there (a sliding window's); such a layer
      runs the concat variant.
    """

    def __init__(
        self,
        keys,
        mask: torch.Tensor | None,
        *,
        rows: tuple = (),
        sequence=None,
        capture=None,
        stop_after: int | None = None,
        variant: str = "concat",
        causal_own: bool = False,
        keys_visible: bool = True,
        layer_masks: dict[int, torch.Tensor] | None = None,
    ) -> None:
        if variant not in ATTENTION_VARIANTS:
            raise ValueError(f"attention variant {variant!r} unknown; valid: {ATTENTION_VARIANTS}")
        self.keys, self.mask, self.rows, self.sequence = keys, mask, rows, sequence
        self.capture, self.stop_after, self.variant = capture, stop_after, variant
        self.lazy = getattr(keys, "lazy", False)
        self.layer_masks = layer_masks or {}
        self._own_mask = self._split_mask = self._keys_mask = None
        if variant == "split" and mask is not None:
            n_own = mask.shape[-2] if sequence is None else sequence.length
            n_keys = mask.shape[-1] - n_own
            causal = causal_own and sequence is None
            if n_keys:
                self._own_mask = None if causal else mask[..., n_keys:]
                # Built once per microbatch, eagerly (it may inspect the mask), shared by every layer.
                self._split_mask = suffix_bias(self._own_mask, _dtype_of(keys), causal=causal)
                self._keys_mask = None if keys_visible else mask[..., :n_keys]

    def bind(self, wrappers: list[PrefixAwareAttention]) -> None:
        """Begin the keys' read; unless lazy, hand each wrapped layer its cached K/V for this forward."""
        stop = self.stop_after  # a forward that stops there reads no cached K/V from that layer on
        if hasattr(self.keys, "begin"):
            self.keys.begin(stop)
        if not self.lazy:
            for wrapper in wrappers:
                read = stop is None or wrapper.layer < stop
                wrapper.__dict__["prefix_kv"] = self.keys(wrapper.layer, None) if read else None

    def unbind(self) -> None:
        if hasattr(self.keys, "end"):
            self.keys.end()

    def __call__(self, wrapper: PrefixAwareAttention, q, k, v, *, scale, enable_gqa):
        if self.capture is not None:
            self.capture.capture(wrapper.layer, k, v)
            if wrapper.layer == self.stop_after:
                raise PrefixCaptured
        cached = self.keys(wrapper.layer, None) if self.lazy else wrapper.prefix_kv
        if cached is None and self.mask is None and self.sequence is None:
            return wrapper.inner(q, k, v, scale=scale, enable_gqa=enable_gqa, is_causal=True)
        k, v = _whole_sequence(self.sequence, k, v)
        # read the layer index only where a layer has its own mask: a compiled block would guard on it per layer
        mask = self.layer_masks.get(wrapper.layer, self.mask) if self.layer_masks else self.mask
        if cached is not None and self.variant == "split" and mask is self.mask:
            return split_attention(
                q, k, v, *cached, self._own_mask, scale=scale, prepared=self._split_mask,
                keys_mask=self._keys_mask, backends=sdpa_backends(wrapper),
            )  # fmt: skip
        if cached is not None:
            b = q.shape[0]
            k = torch.cat([cached[0].expand(b, -1, -1, -1), k], dim=2)  # b copies of the cached K/V
            v = torch.cat([cached[1].expand(b, -1, -1, -1), v], dim=2)
        return _masked_sdpa(wrapper, q, k, v, mask, scale, enable_gqa)


def _dtype_of(keys) -> torch.dtype | None:
    """The dtype the cached K/V were computed in (the split bias's dtype), or None."""
    return getattr(keys, "compute_dtype", None)


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


class MaskedAttention:
    """Plain attention under an explicit mask (the baseline's packed layout; under the model's backend list);
    with neither a mask nor a sequence exchange it is the wrapped module's own causal attention."""

    def __init__(self, mask: torch.Tensor, sequence=None, layer_masks=None) -> None:
        self.mask = mask
        self.sequence = sequence  # the microbatch's sequence exchange when its tokens are sharded
        self.layer_masks = layer_masks or {}  # per layer, a mask in place of ``mask`` (sliding windows)

    def __call__(self, wrapper: PrefixAwareAttention, q, k, v, *, scale, enable_gqa):
        if self.mask is None and self.sequence is None:
            return wrapper.inner(q, k, v, scale=scale, enable_gqa=enable_gqa, is_causal=True)
        k, v = _whole_sequence(self.sequence, k, v)
        mask = self.layer_masks.get(wrapper.layer, self.mask) if self.layer_masks else self.mask
        return _masked_sdpa(wrapper, q, k, v, mask, scale, enable_gqa)
