"""The training-time KV cache: per-layer prefix K/V (forward half) and gK/gV (backward half).

Phase A ``capture``s each layer's live prefix K/V (graph attached) and hands Phase B detached leaves that
require grad; every suffix microbatch reads the leaves, and its backward accumulates gK/gV into
``leaf.grad``. Phase C ``backward_prefix`` injects the accumulated gradients into the live tensors and runs
the retained prefix graph once. ``release`` drops everything; nothing survives a group.

How a layer's suffix attention gets its *full* prefix view, and where gK/gV go back, is the cache's
:class:`PrefixView`. The default reads the cache's own leaves (the whole prefix lives on this rank) and autograd
accumulates gK/gV straight into ``leaf.grad``. A parallel layout supplies another view through its schedule hook
(``ScheduleHooks.prefix_view``): context parallelism all-gathers each layer's prefix shards from the CP group and
reduce-scatters the gathered view's gK/gV back into the owners' leaves (``prefixflow.parallel.cp``).

Recurrent layers (gated DeltaNet, Mamba-2) keep their prefix boundary, the end state and conv tail, in the
cache's ``states`` (:class:`~prefixflow.state.recurrent.StateCache`); Phase C seeds them in the same backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .recurrent import StateCache

__all__ = ["PrefixKVCache", "LayerKV", "PrefixView"]


@dataclass
class LayerKV:
    live_k: torch.Tensor  # [1, H_kv, P_c, D], attached to the prefix graph
    live_v: torch.Tensor
    prefix_k: torch.Tensor  # detached leaf read by suffixes; .grad accumulates gK
    prefix_v: torch.Tensor


class PrefixView:
    """How suffix attention reads each layer's full prefix K/V: here, the cache's own leaves.

    ``lazy``: False = every layer's view is read once when a suffix microbatch binds the cache (a compiled
    block then gets it as a graph input); True = each layer reads its view when its attention runs, so a view
    that moves data can overlap the move with the previous layer's compute. ``begin``/``end`` bracket one
    suffix microbatch's forward. The returned K/V must be differentiable w.r.t. the leaves: their backward is
    where gK/gV go back.
    """

    lazy = False

    def begin(self, cache: PrefixKVCache, stop: int | None = None) -> None:
        """Before one forward that reads no layer from ``stop`` on (None: every layer)."""
        return None

    def read(self, cache: PrefixKVCache, layer: int, dtype: torch.dtype):
        entry = cache.layers.get(layer)
        if entry is None:
            return None
        return entry.prefix_k.to(dtype), entry.prefix_v.to(dtype)

    def end(self) -> None:
        return None


class PrefixKVCache:
    """Per-layer prefix K/V leaves and their gradient accumulators for one rollout group.

    ``grad_dtype``: dtype of the leaves and therefore of gK/gV accumulation (fp32 when the model computes in
    bf16/fp16, so many suffix microbatches do not accumulate in low precision). Suffixes read
    ``leaf.to(compute dtype)``, whose backward casts the gradient up before accumulating.
    """

    def __init__(self, grad_dtype: torch.dtype | None = None, view: PrefixView | None = None) -> None:
        self.grad_dtype = grad_dtype
        self.layers: dict[int, LayerKV] = {}
        self.prefix_loss: torch.Tensor | None = None  # loss terms of the prefix graph itself (Phase A)
        self.view = view or PrefixView()
        self.states = StateCache(grad_dtype)  # recurrent layers' end states (prefixflow.state.recurrent)

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def prefix_len(self) -> int:
        """Prefix tokens held here (this rank's shard when the prefix is sequence-sharded)."""
        if not self.layers:
            return 0
        return next(iter(self.layers.values())).live_k.shape[-2]

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype the model computed the prefix K/V in (``None`` while the cache is empty)."""
        if not self.layers:
            return None
        return next(iter(self.layers.values())).live_k.dtype

    def capture(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep a layer's live prefix K/V and create the leaves the suffixes will read."""
        if layer in self.layers:
            raise RuntimeError(
                f"layer {layer} captured twice in one Phase A; release() the cache between groups"
            )
        dtype = self.grad_dtype or k.dtype
        self.layers[layer] = LayerKV(
            live_k=k,
            live_v=v,
            prefix_k=k.detach().to(dtype).requires_grad_(True),
            prefix_v=v.detach().to(dtype).requires_grad_(True),
        )

    def read(self, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The full prefix K/V view of ``layer`` in the compute dtype, through the cache's :class:`PrefixView`
        (``None`` when the prefix is empty)."""
        return self.view.read(self, layer, dtype)

    def grad_kv(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Accumulated gK/gV of ``layer`` (``None`` before any suffix backward)."""
        entry = self.layers[layer]
        return entry.prefix_k.grad, entry.prefix_v.grad

    def nbytes(self) -> int:
        """Bytes held by the cache's leaves and gradient accumulators (live K/V are the model's own)."""
        total = 0
        for e in self.layers.values():
            for t in (e.prefix_k, e.prefix_v, e.prefix_k.grad, e.prefix_v.grad):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total + self.states.nbytes()

    def add_prefix_loss(self, loss: torch.Tensor | None) -> None:
        """Keep a scalar the prefix forward added to the objective (e.g. an MoE balance loss over the prefix
        tokens); Phase C backpropagates it with gK/gV."""
        if loss is not None:
            self.prefix_loss = loss if self.prefix_loss is None else self.prefix_loss + loss

    def backward_prefix(self, extra_roots=(), extra_grads=()) -> None:
        """Phase C: one backward through the retained prefix graph, seeded with the accumulated gK/gV (and
        with 1 for the prefix's own loss terms). ``extra_roots``/``extra_grads``: more seeds of the same
        backward (a pipeline stage's prefix output and the gradient the next stage sent back for it)."""
        roots, grads = list(extra_roots), list(extra_grads)
        if self.prefix_loss is not None and self.prefix_loss.requires_grad:
            roots.append(self.prefix_loss)
            grads.append(torch.ones_like(self.prefix_loss))
        for entry in self.layers.values():
            for live, leaf in ((entry.live_k, entry.prefix_k), (entry.live_v, entry.prefix_v)):
                if leaf.grad is None or not live.requires_grad:
                    continue
                roots.append(live)
                grads.append(leaf.grad.to(live.dtype))
        state_roots, state_grads = self.states.roots()
        roots += state_roots
        grads += state_grads
        if roots:
            torch.autograd.backward(roots, grads)

    def release(self) -> None:
        """Drop live K/V (and with them the prefix graph), leaves and accumulators."""
        for entry in self.layers.values():
            entry.prefix_k.grad = None
            entry.prefix_v.grad = None
        self.layers.clear()
        self.states.release()
        self.prefix_loss = None
