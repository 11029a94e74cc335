"""A split rollout group (paper §4.7): the owner runs Phase A and sends each helper only the prefix K/V;
every rank runs Phase B on its share of the suffixes; helpers send their gK/gV back; the owner sums them and
runs Phase C. Both sides derive the K/V geometry from the model and the group, so nothing crosses ranks but
the K/V and gK/gV, and :class:`PrefixExchange` counts every byte it sends."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..attention.modes import PrefixAwareAttention
from ..group import RolloutGroup
from ..model.models import head_dim_of, model_args
from ..schedule.driver import GroupShare, GroupStats, train_share
from ..state.kv_cache import PrefixKVCache
from . import parallel_state
from .dp_placement import Work
from .sequence import SequenceLayout

__all__ = [
    "PrefixKVGeometry",
    "prefix_kv_geometry",
    "check_captured",
    "PrefixExchange",
    "SplitShare",
    "train_split_part",
]


# -- the K/V exchange of a split group -----------------------------------------------------------------
@dataclass(frozen=True)
class PrefixKVGeometry:
    """What a split group's owner captures in Phase A, per layer: K and V of shape
    ``[1, kv_heads, tokens, head_dim]`` in ``dtype``. Every rank derives it from the model and the group
    (:func:`prefix_kv_geometry`), so the exchange moves nothing but the K/V and gK/gV themselves."""

    layers: tuple[int, ...]
    kv_heads: int
    tokens: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (1, self.kv_heads, self.tokens, self.head_dim)

    @property
    def numel(self) -> int:
        return 2 * len(self.layers) * self.kv_heads * self.tokens * self.head_dim


def prefix_kv_geometry(model: nn.Module, group: RolloutGroup) -> PrefixKVGeometry:
    """The prefix K/V this rank's model captures for ``group`` in Phase A: every wrapped layer, the local KV
    heads (TP shards heads), ``prompt_len - 1`` tokens (this rank's balanced shard under CP), the compute
    dtype (FSDP2's ``param_dtype`` when set)."""
    args = model_args(model)
    state = parallel_state(model)
    tp = state.dims.tp if state is not None else 1
    cp = state.dims.cp if state is not None else 1
    tokens = group.prompt_len - 1
    if cp > 1 and tokens > 0:
        tokens = SequenceLayout(tokens, cp).local_len
    dtype = state.compute_dtype if state is not None and state.compute_dtype is not None else None
    layers = tuple(sorted(m.layer for m in model.modules() if isinstance(m, PrefixAwareAttention)))
    return PrefixKVGeometry(
        layers=layers if tokens > 0 else (),
        kv_heads=(args.n_kv_heads or args.n_heads) // tp,
        tokens=tokens,
        head_dim=head_dim_of(args),
        dtype=dtype or next(model.parameters()).dtype,
    )


def check_captured(cache: PrefixKVCache, geometry: PrefixKVGeometry) -> None:
    """Raise if the owner's captured prefix K/V differ from the geometry its helpers derived (they would
    receive a tensor of the wrong size or layout)."""
    got = sorted(cache.layers)
    bad = [
        (i, tuple(e.live_k.shape), e.live_k.dtype)
        for i, e in sorted(cache.layers.items())
        for t in (e.live_k, e.live_v)
        if tuple(t.shape) != geometry.shape or t.dtype != geometry.dtype
    ]
    if got != list(geometry.layers) or bad:
        raise RuntimeError(
            f"split group: the owner captured layers {got} (first mismatch: {bad[:1]}) but its helpers expect "
            f"layers {list(geometry.layers)} of shape {geometry.shape} in {geometry.dtype}; "
            "prefix_kv_geometry does not describe this model"
        )


@dataclass
class PrefixExchange:
    """Point-to-point transfers of a split group's prefix K/V (owner -> helpers) and gK/gV (helpers ->
    owner) between DP ranks ``peers`` (global ranks by DP coordinate). Both sides know the sizes from
    :func:`prefix_kv_geometry`: only the K/V and gK/gV cross, and every byte sent is counted."""

    peers: list[int]
    kv_bytes: int = 0
    grad_kv_bytes: int = 0
    expected_kv_bytes: int = 0
    expected_grad_kv_bytes: int = 0

    def _send(self, tensor: torch.Tensor, to: int) -> int:
        dist.send(tensor.contiguous(), dst=self.peers[to])
        return tensor.numel() * tensor.element_size()

    def send_prefix(self, cache: PrefixKVCache, geometry: PrefixKVGeometry, helpers: list[int]) -> None:
        check_captured(cache, geometry)
        if not geometry.layers:
            return
        layers = [cache.layers[i] for i in geometry.layers]
        flat = torch.cat([t.detach().reshape(-1) for e in layers for t in (e.live_k, e.live_v)])
        for r in helpers:
            self.kv_bytes += self._send(flat, r)
            self.expected_kv_bytes += sum(
                t.numel() * t.element_size() for e in layers for t in (e.live_k, e.live_v)
            )

    def receive_prefix(
        self, cache: PrefixKVCache, geometry: PrefixKVGeometry, owner: int, device: torch.device
    ) -> None:
        if not geometry.layers:
            return
        flat = torch.empty(geometry.numel, dtype=geometry.dtype, device=device)
        dist.recv(flat, src=self.peers[owner])
        kv = flat.view(len(geometry.layers), 2, *geometry.shape)
        for i, layer in enumerate(geometry.layers):
            cache.capture(layer, kv[i, 0], kv[i, 1])

    def send_grad_kv(self, cache: PrefixKVCache, owner: int) -> None:
        grads = []
        for i in sorted(cache.layers):
            e = cache.layers[i]
            for leaf in (e.prefix_k, e.prefix_v):
                grads.append((leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)).reshape(-1))
        if grads:
            self.grad_kv_bytes += self._send(torch.cat(grads), owner)

    def receive_grad_kv(self, cache: PrefixKVCache, helpers: list[int]) -> None:
        leaves = [
            leaf
            for i in sorted(cache.layers)
            for leaf in (cache.layers[i].prefix_k, cache.layers[i].prefix_v)
        ]
        if not leaves:
            return
        numel = sum(leaf.numel() for leaf in leaves)
        for r in helpers:
            flat = torch.empty(numel, dtype=leaves[0].dtype, device=leaves[0].device)
            dist.recv(flat, src=self.peers[r])
            self.expected_grad_kv_bytes += sum(leaf.numel() * leaf.element_size() for leaf in leaves)
            for leaf, g in zip(leaves, flat.split([leaf.numel() for leaf in leaves]), strict=True):
                g = g.view_as(leaf)
                leaf.grad = g.clone() if leaf.grad is None else leaf.grad + g


class SplitShare(GroupShare):
    """This rank's part of a split group (see the module docstring): its responses; the owner computes the
    prefix and sends the K/V, a helper receives them; in Phase C helpers send gK/gV and the owner sums them
    before its prefix backward. The loss weights stay the group's."""

    def __init__(self, model: nn.Module, group: RolloutGroup, work: Work, me: int, exchange: PrefixExchange):
        self.work, self.exchange, self.owner = work, exchange, me == work.owner
        self.helpers = [r for r in work.ranks if r != work.owner]
        self.geometry = prefix_kv_geometry(model, group)

    def paths(self, n: int) -> list[int]:
        return list(self.work.responses)

    def computes_prefix(self) -> bool:
        return self.owner

    def prefix_forward(self, run, caches, compute) -> None:
        cache = caches.only()
        if not self.owner:
            if cache is not None:
                self.exchange.receive_prefix(cache, self.geometry, self.work.owner, run.device)
            return
        compute()  # every cached node, even when the owner trains none of the responses itself
        if cache is not None:
            self.exchange.send_prefix(cache, self.geometry, self.helpers)

    def prefix_backward(self, run, caches, compute) -> None:
        cache = caches.only()
        if not self.owner:
            if cache is not None:
                self.exchange.send_grad_kv(cache, self.work.owner)
            return
        if cache is not None:
            self.exchange.receive_grad_kv(cache, self.helpers)
        compute()


def train_split_part(
    model, group: RolloutGroup, work: Work, me: int, exchange: PrefixExchange, **kwargs
) -> GroupStats:
    """This rank's part of a split group through the one driver (``kwargs``: ``train_group``'s)."""
    return train_share(model, group, SplitShare(model, group, work, me, exchange), **kwargs)
