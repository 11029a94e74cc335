"""Sequence-sharded attention both systems share (context parallelism on any backend).

torch's ``context_parallel`` has no CPU kernels, so the exchange is built from collectives every backend has
(all-gather, reduce-scatter), on CPU (gloo) and GPU (NCCL) alike:

- **Sharding** (:func:`shard_microbatch`). Every sequence the schedule runs (Phase A's prefix, each suffix
  microbatch, each baseline microbatch) is cut on its own into ``2·cp`` equal chunks (padded to a multiple);
  rank ``r`` keeps chunks ``r`` and ``2·cp-1-r`` (head–tail), so every rank holds as many cheap early causal
  rows as expensive late ones. The microbatch keeps this rank's tokens, their global RoPE positions, its loss
  positions and the mask rows of its queries over every key. Each rank scores only its own tokens, with the
  group's fixed weights, so rank losses and gradients sum to the single-process ones.
- **Attention** (:class:`SequenceExchange`). Before attending, a layer all-gathers the sequence's K/V into
  token order; the backward reduce-scatters dK/dV to the owners. The baseline runs exactly this attention
  over its full sequences; only the schedule differs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields, replace

import torch
import torch.distributed as dist

from ..schedule.host import on_host
from ..tree.layouts import Microbatch

__all__ = ["SequenceLayout", "CommStats", "Blocked", "Collectives", "SequenceExchange", "shard_microbatch"]


class SequenceLayout:
    """Head–tail split of ``length`` tokens over ``size`` ranks (causal load balancing).

    ``indices[r]``: the token indices rank ``r`` holds, in its local order (values ``>= length`` are padding);
    ``order[j]``: where token ``j`` sits in the rank-major concatenation of every rank's local tokens.
    """

    def __init__(self, length: int, size: int) -> None:
        if length < 1 or size < 1:
            raise ValueError(f"SequenceLayout needs length >= 1 and size >= 1, got {length}, {size}")
        self.length, self.size = length, size
        self.chunk = math.ceil(length / (2 * size))
        self.local_len = 2 * self.chunk
        c = self.chunk
        self.indices = torch.stack(
            [
                torch.cat(
                    [
                        torch.arange(r * c, (r + 1) * c),
                        torch.arange((2 * size - 1 - r) * c, (2 * size - r) * c),
                    ]
                )
                for r in range(size)
            ]
        )
        self.order = torch.argsort(self.indices.reshape(-1))[:length]
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indices, order)`` on ``device`` (moved once)."""
        if device not in self._on:
            self._on[device] = (self.indices.to(device), self.order.to(device))
        return self._on[device]


@dataclass
class CommStats:
    """What the CP exchange did in one group. Times in seconds, bytes as received (gathers) or sent
    (reduce-scatters) by this rank over the network, i.e. ``(cp-1)/cp`` of the buffer.

    ``exposed_s``: time the computation spent blocked on prefix-K/V communication: waiting on a gather handle
    (``gather_wait_s``) plus the blocking gK/gV reduce-scatters (``scatter_s``); ``overlapped_s``: the part of
    prefetched gathers' time in flight that nothing waited on; ``sequence_s``: the blocking K/V exchange of the
    sequence-sharded attention, all phases (``sequence_phase_b_s``: its part in Phase B, or in the baseline's
    step); ``unused_prefetches``: prefetched gathers no layer read (wasted wire). Times measured with CUDA events
    are read by :meth:`resolve`."""

    demand_gathers: int = 0
    prefetched_gathers: int = 0
    unused_prefetches: int = 0
    scatters: int = 0
    gather_bytes: int = 0
    scatter_bytes: int = 0
    gather_wait_s: float = 0.0
    scatter_s: float = 0.0
    exposed_s: float = 0.0
    overlapped_s: float = 0.0
    sequence_exchanges: int = 0
    sequence_bytes: int = 0
    sequence_s: float = 0.0
    sequence_phase_b_s: float = 0.0
    _in_phase_b: bool = False
    _pending: list = field(default_factory=list)

    def add(self, names: tuple[str, ...], seconds: float, in_flight: float | None = None) -> None:
        """``seconds`` blocked, added to each field in ``names``; a prefetched gather that was ``in_flight``
        that long overlapped the rest."""
        for name in names:
            setattr(self, name, getattr(self, name) + seconds)
        if in_flight is not None:
            self.overlapped_s += max(0.0, in_flight - seconds)

    def resolve(self) -> None:
        """Read the CUDA event pairs of the group (one synchronisation)."""
        if self._pending:
            torch.cuda.synchronize()
            for names, begin, end, in_flight in self._pending:
                self.add(names, begin.elapsed_time(end) / 1000.0, in_flight)
            self._pending.clear()

    def as_dict(self, prefix: str = "cp_") -> dict[str, float]:
        self.resolve()
        return {prefix + f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


class Blocked:
    """How long the computation waits for one communication. On CPU the host itself blocks (``perf_counter``).
    On CUDA a collective's host call returns at once and the compute stream waits instead, so a CUDA event pair
    on the current stream brackets the wait; it is read by ``CommStats.resolve`` at the end of the group."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.begin = torch.cuda.Event(enable_timing=True)
            self.begin.record()
        else:
            self.begin = time.perf_counter()

    def stop(self, stats: CommStats, names: tuple[str, ...], in_flight: float | None = None) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            stats._pending.append((names, self.begin, end, in_flight))
        else:
            stats.add(names, time.perf_counter() - self.begin, in_flight)


class Collectives:
    """The two collectives CP uses, behind one seam (tests substitute a deferred variant to prove that every
    prefetched gather is waited on before its buffer is read)."""

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, process_group, async_op: bool = False):
        """``out[r] = inp`` of rank ``r`` (``out``: ``[size, *inp.shape]``)."""
        return dist.all_gather_into_tensor(out.flatten(0, 1), inp, group=process_group, async_op=async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, process_group) -> None:
        dist.reduce_scatter_tensor(out, inp, group=process_group)


def _wire(nbytes: int, size: int) -> int:
    return nbytes * (size - 1) // size


def _wide(dtype: torch.dtype) -> torch.dtype:
    """Gradients are summed over ranks in fp32 at least (bf16 partial sums would lose precision)."""
    return torch.promote_types(dtype, torch.float32)


class _GatherSequence(torch.autograd.Function):
    """All-gather K/V shards into token order; backward reduce-scatters dK/dV to their owners."""

    @staticmethod
    def forward(ctx, k, v, exchange: SequenceExchange):
        ctx.exchange = exchange
        return exchange.forward(k, v)

    @staticmethod
    def backward(ctx, grad_k, grad_v):
        return (*ctx.exchange.backward(grad_k, grad_v), None)


class SequenceExchange:
    """The K/V exchange of one sharded microbatch: ``gather(k, v)`` returns the whole sequence's K/V in token
    order (``[b, H_kv, length, D]``) from this rank's ``[b, H_kv, local_len, D]``, differentiably."""

    def __init__(
        self, process_group, layout: SequenceLayout, stats: CommStats, collectives: Collectives
    ) -> None:
        self.process_group, self.layout = process_group, layout
        self.stats, self.collectives = stats, collectives
        self.length = layout.length

    def gather(self, k: torch.Tensor, v: torch.Tensor):
        return _GatherSequence.apply(k, v, self)

    def forward(self, k, v):
        size = self.layout.size
        local = torch.stack([k, v]).contiguous()  # [2, b, H, l, D]
        out = local.new_empty((size, *local.shape))
        blocked = Blocked(out.device)
        self.collectives.all_gather(out, local, self.process_group)
        self._count(out, blocked)
        _, order = self.layout.on(k.device)
        two, b, h, _, d = local.shape
        whole = out.permute(1, 2, 3, 0, 4, 5).reshape(two, b, h, size * self.layout.local_len, d)
        return whole[0].index_select(2, order), whole[1].index_select(2, order)

    def backward(self, grad_k, grad_v):
        size, local_len = self.layout.size, self.layout.local_len
        ref = grad_k if grad_k is not None else grad_v
        b, h, _, d = ref.shape
        wide = _wide(ref.dtype)
        buf = torch.zeros(2, b, h, size * local_len, d, dtype=wide, device=ref.device)
        _, order = self.layout.on(ref.device)
        for i, g in enumerate((grad_k, grad_v)):
            if g is not None:
                buf[i].index_copy_(2, order, g.to(wide))
        send = buf.view(2, b, h, size, local_len, d).permute(3, 0, 1, 2, 4, 5).contiguous()
        recv = buf.new_empty(2, b, h, local_len, d)
        blocked = Blocked(recv.device)
        self.collectives.reduce_scatter(recv, send.view(size * 2, b, h, local_len, d), self.process_group)
        self._count(send, blocked)
        return recv[0].to(ref.dtype), recv[1].to(ref.dtype)

    def _count(self, buf: torch.Tensor, blocked: Blocked) -> None:
        self.stats.sequence_exchanges += 1
        self.stats.sequence_bytes += _wire(buf.numel() * buf.element_size(), self.layout.size)
        names = ("sequence_s", "sequence_phase_b_s") if self.stats._in_phase_b else ("sequence_s",)
        blocked.stop(self.stats, names)


def shard_microbatch(
    mb: Microbatch,
    rank: int,
    size: int,
    process_group,
    stats: CommStats,
    collectives: Collectives | None = None,
) -> Microbatch:
    """This rank's head–tail share of ``mb``: tokens, global positions, mask rows, loss positions.

    Padding tokens (when the length is not a multiple of ``2·size``) get token 0 and the last real position,
    attend to every key (so no row is fully masked) and carry no loss; their gradient is exactly zero.
    """
    b, length = mb.tokens.shape
    device = mb.tokens.device
    with on_host():  # index work over the caller's tokens and positions: real under an estimate too
        layout = SequenceLayout(length, size)
        indices, _ = layout.on(device)
        idx = indices[rank]
        real = idx < length
        take = idx.clamp(max=length - 1)
        tokens = mb.tokens[:, take].masked_fill(~real, 0)
        positions = mb.positions if mb.positions is not None else torch.arange(length, device=device)[None]
        positions = positions[:, take]
        local_col = torch.full((length,), -1, dtype=torch.long, device=device)
        local_col[idx[real]] = torch.arange(layout.local_len, device=device)[real]
        cols = local_col[mb.loss_cols]
        keep = cols >= 0
        loss = dict(loss_rows=mb.loss_rows[keep], loss_cols=cols[keep], targets=mb.targets[keep],
                    response_ids=mb.response_ids[keep], token_ids=mb.token_ids[keep])  # fmt: skip
    if mb.mask is not None:
        mask = mb.mask[:, :, take, :]
    else:  # plain causal over the whole sequence
        keys = torch.arange(length, device=device)
        mask = (keys.unsqueeze(0) <= take.unsqueeze(1)).view(1, 1, layout.local_len, length)
    mask = mask.masked_fill(~real.view(1, 1, -1, 1), True)
    return replace(
        mb,
        tokens=tokens,
        positions=positions,
        mask=mask,
        **loss,
        sequence=SequenceExchange(process_group, layout, stats, collectives or Collectives()),
    )
