"""Data parallelism: rollout groups placed on DP ranks by cost, split groups, one gradient sync per step.

A step's groups go to the ``batch`` ranks (``dp_replicate x dp_shard``) by longest-processing-time over each
group's cost (:func:`group_costs`, a FLOP model of what the system runs). Each rank trains its groups whole.
When whole-group placement leaves the busiest rank more than ``split_threshold`` above the mean, the
largest group is split (paper §4.7): its owner runs Phase A and sends each helper only the prefix K/V; every
rank runs Phase B on its share of the suffixes; helpers send their accumulated gK/gV back; the owner sums
them and runs Phase C. Nothing else crosses ranks, and :class:`PrefixExchange` counts those bytes. A split
baseline group needs no exchange (its sequences are independent).

Gradients then add up across DP once per step: FSDP2 reduce-scatters every unit once (HSDP also
all-reduces across ``dp_replicate``); with ``dp_replicate`` alone one all-reduce per dtype. Under ZeRO-3
FSDP every rank must run the same sequence of forwards and backwards, so a step whose ranks do different
work holds the parameters gathered for the step (``fsdp.gathered_for_step``).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..apply import runtime_of
from ..budget import FixedPlan
from ..group import RolloutGroup
from ..hooks import hooks_of
from ..kv_cache import PrefixKVCache
from ..loss import resolve_loss
from ..models import head_dim_of, hidden_dim_of, model_args
from ..schedule import (
    GroupStats,
    _baseline,
    _PhaseClock,
    _validate,
    phase_a_prefix_forward,
    phase_b_suffix_microbatches,
    phase_c_prefix_backward,
    train_group,
)
from . import fsdp as fsdp_mod
from . import parallel_state

__all__ = [
    "Work",
    "Placement",
    "StepStats",
    "PrefixExchange",
    "group_costs",
    "place_groups",
    "train_step",
    "all_reduce_gradients",
]


# -- cost model ----------------------------------------------------------------------------------------
def group_costs(model: nn.Module, group: RolloutGroup, system: str) -> tuple[float, list[float]]:
    """``(prefix_cost, response_costs)`` in FLOPs (forward + backward = 3x forward) of training ``group``.

    Per layer a token costs its projections and MLP, and every (query, key) pair it attends costs the two
    attention matmuls; each loss token pays the LM head. PrefixFlow pays the prefix once (``prefix_cost``);
    the baseline pays it in every sequence (``prefix_cost`` is 0).
    """
    args = model_args(model)
    hd, nq = head_dim_of(args), args.n_heads
    nkv = args.n_kv_heads or nq
    per_token = args.n_layers * (2 * args.dim * hd * (2 * nq + 2 * nkv) + 6 * args.dim * hidden_dim_of(args))
    per_pair = args.n_layers * 4 * nq * hd
    head = 2 * args.dim * args.vocab_size
    p = group.prompt_len
    if system == "prefixflow":
        c = p - 1
        prefix = 3.0 * (per_token * c + per_pair * c * (c + 1) / 2)
        resp = [
            3.0 * (per_token * s + per_pair * (s * c + s * (s + 1) / 2) + head * s)
            for s in group.response_lens
        ]
        return prefix, resp
    if system == "baseline":
        resp = []
        for s in group.response_lens:
            n = p + s - 1
            resp.append(3.0 * (per_token * n + per_pair * n * (n + 1) / 2 + head * s))
        return 0.0, resp
    raise ValueError(f"system {system!r} unknown; valid: ('prefixflow', 'baseline')")


# -- placement -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Work:
    """One rank's share of one group: ``responses`` it trains; ``owner`` runs Phase A/C; ``ranks`` hold
    parts of the group (one rank for a whole group)."""

    group: int
    responses: tuple[int, ...]
    owner: int
    ranks: tuple[int, ...]

    @property
    def split(self) -> bool:
        return len(self.ranks) > 1


@dataclass
class Placement:
    """Per DP rank: its work in execution order (split groups first, in group order, then whole groups)."""

    work: list[list[Work]]
    loads: list[float]
    split_groups: tuple[int, ...]

    @property
    def imbalance(self) -> float:
        """Busiest rank over the mean load, minus one (0 = perfectly balanced)."""
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean - 1.0 if mean > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "work": [[(w.group, list(w.responses), w.owner) for w in ws] for ws in self.work],
            "loads": self.loads,
            "split_groups": list(self.split_groups),
        }


def _imbalance(loads: list[float]) -> float:
    mean = sum(loads) / len(loads)
    return max(loads) / mean - 1.0 if mean > 0 else 0.0


def place_groups(
    costs: list[tuple[float, list[float]]], n_ranks: int, split_threshold: float | None = 0.25
) -> Placement:
    """Longest-processing-time placement of whole groups, then the split fallback.

    ``costs``: per group ``(prefix_cost, response_costs)``. While the busiest rank is more than
    ``split_threshold`` above the mean load (None: never split), the largest unsplit group with two or more
    responses is split: its owner (the least-loaded rank without it) pays the prefix, and its responses go,
    largest first, to the least-loaded ranks. A split that does not lower the imbalance is undone and the
    search stops. Deterministic: every rank computes the same placement.
    """
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    if split_threshold is not None and split_threshold < 0:
        raise ValueError(f"split_threshold must be >= 0 or None, got {split_threshold}")
    whole = [p + sum(r) for p, r in costs]
    order = sorted(range(len(costs)), key=lambda g: (-whole[g], g))
    shares: dict[int, dict[int, list[int]]] = {}  # group -> rank -> responses
    owner: dict[int, int] = {}
    loads = [0.0] * n_ranks
    for g in order:
        r = min(range(n_ranks), key=lambda i: (loads[i], i))
        loads[r] += whole[g]
        shares[g] = {r: list(range(len(costs[g][1])))}
        owner[g] = r
    split: list[int] = []
    while split_threshold is not None and n_ranks > 1 and _imbalance(loads) > split_threshold:
        candidates = [g for g in order if g not in split and len(costs[g][1]) > 1]
        if not candidates:
            break
        g = candidates[0]
        before = (list(loads), shares[g], owner[g])
        loads[owner[g]] -= whole[g]
        prefix, resp = costs[g]
        new_owner = min(range(n_ranks), key=lambda i: (loads[i], i))
        loads[new_owner] += prefix
        parts: dict[int, list[int]] = {new_owner: []}
        for i in sorted(range(len(resp)), key=lambda i: (-resp[i], i)):
            r = min(range(n_ranks), key=lambda k: (loads[k], k))
            loads[r] += resp[i]
            parts.setdefault(r, []).append(i)
        if _imbalance(loads) >= _imbalance(before[0]) or len(parts) == 1:
            loads, shares[g], owner[g] = before
            break
        shares[g] = {r: sorted(v) for r, v in parts.items()}
        owner[g] = new_owner
        split.append(g)
    work: list[list[Work]] = [[] for _ in range(n_ranks)]
    for g in sorted(split) + sorted(set(range(len(costs))) - set(split)):
        ranks = tuple(sorted(shares[g]))
        for r in ranks:
            work[r].append(Work(g, tuple(shares[g][r]), owner[g], ranks))
    return Placement(work, loads, tuple(sorted(split)))


# -- the K/V exchange of a split group -----------------------------------------------------------------
_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@dataclass
class PrefixExchange:
    """Point-to-point transfers of a split group's prefix K/V (owner -> helpers) and gK/gV (helpers ->
    owner) between DP ranks ``peers`` (global ranks by DP coordinate). Counts the bytes it moves: payload
    (K/V, gK/gV) apart from a 5-integer header (layers, KV heads, prefix length, head dim, dtype)."""

    peers: list[int]
    kv_bytes: int = 0
    grad_kv_bytes: int = 0
    header_bytes: int = 0
    expected_kv_bytes: int = 0
    expected_grad_kv_bytes: int = 0

    def _send(self, tensor: torch.Tensor, to: int) -> int:
        dist.send(tensor.contiguous(), dst=self.peers[to])
        return tensor.numel() * tensor.element_size()

    def send_prefix(self, cache: PrefixKVCache, helpers: list[int], device: torch.device) -> None:
        layers = [cache.layers[i] for i in sorted(cache.layers)]
        if layers:
            _, h, c, d = layers[0].live_k.shape
            dtype = layers[0].live_k.dtype
            header = torch.tensor(
                [len(layers), h, c, d, _DTYPES.index(dtype)], dtype=torch.int64, device=device
            )
            flat = torch.cat([t.detach().reshape(-1) for e in layers for t in (e.live_k, e.live_v)])
        else:
            header = torch.zeros(5, dtype=torch.int64, device=device)
        for r in helpers:
            self.header_bytes += self._send(header, r)
            if layers:
                self.kv_bytes += self._send(flat, r)
                self.expected_kv_bytes += sum(
                    t.numel() * t.element_size() for e in layers for t in (e.live_k, e.live_v)
                )

    def receive_prefix(self, cache: PrefixKVCache, owner: int, device: torch.device) -> None:
        header = torch.empty(5, dtype=torch.int64, device=device)
        dist.recv(header, src=self.peers[owner])
        n_layers, h, c, d, code = header.tolist()
        if n_layers == 0:
            return
        flat = torch.empty(n_layers * 2 * h * c * d, dtype=_DTYPES[code], device=device)
        dist.recv(flat, src=self.peers[owner])
        kv = flat.view(n_layers, 2, 1, h, c, d)
        for layer in range(n_layers):
            cache.capture(layer, kv[layer, 0], kv[layer, 1])

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


def _train_split_part(
    model,
    group: RolloutGroup,
    work: Work,
    me: int,
    exchange: PrefixExchange,
    *,
    system,
    layout,
    microbatch,
    loss,
    loss_config,
    observer,
) -> GroupStats:
    """This rank's part of a split group (see the module docstring); the loss weights stay the group's."""
    runtime = runtime_of(model)
    _validate(model, group, system, layout, microbatch)
    cfg = resolve_loss(loss, loss_config, group)
    device = next(model.parameters()).device
    group = group.to(device)
    size = len(work.responses) if microbatch is None else microbatch
    chunks = [list(work.responses[i : i + size]) for i in range(0, len(work.responses), size)]
    clock = _PhaseClock(device, observer)
    hooks = hooks_of(model)
    helpers = [r for r in work.ranks if r != work.owner]
    suffix_tokens = sum(group.response_lens[i] for i in work.responses)
    if system == "baseline":  # independent sequences: nothing to exchange
        with hooks.group(model, group, system), clock("full"), hooks.phase("full"):
            value = (
                _baseline(model, runtime, group, FixedPlan.of(chunks), layout, loss, cfg) if chunks else 0.0
            )
        return GroupStats(system, layout, value, len(chunks), 0, suffix_tokens, 0, clock.times)
    cache = PrefixKVCache(runtime.grad_kv_dtype(model))
    owner = me == work.owner
    try:
        with hooks.group(model, group, system):
            with clock("A"), hooks.phase("A"):
                if owner:
                    phase_a_prefix_forward(model, runtime, group, cache)
                    exchange.send_prefix(cache, helpers, device)
                else:
                    exchange.receive_prefix(cache, work.owner, device)
            with clock("B"), hooks.phase("B"):
                plan = FixedPlan.of(chunks)
                value = phase_b_suffix_microbatches(model, runtime, group, cache, plan, layout, loss, cfg)
            with clock("C"), hooks.phase("C"):
                if owner:
                    exchange.receive_grad_kv(cache, helpers)
                    phase_c_prefix_backward(cache)
                else:
                    exchange.send_grad_kv(cache, work.owner)
    finally:
        cache.release()
    prefix = group.prompt_len - 1 if owner else 0
    return GroupStats(system, layout, value, len(chunks), prefix, suffix_tokens, 0, clock.times)


# -- gradient sync -------------------------------------------------------------------------------------
def all_reduce_gradients(model: nn.Module, group: dist.ProcessGroup) -> int:
    """Sum every parameter's gradient over ``group`` (missing gradients count as zero): one all-reduce per
    gradient dtype. Returns the number of all-reduces."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in model.parameters():
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        for g, new in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(new.view_as(g))
    return len(by_dtype)


# -- the step ------------------------------------------------------------------------------------------
@dataclass
class StepStats:
    """One optimizer step's worth of groups. ``loss``: the sum of the step's group losses (all ranks);
    ``groups``: this rank's :class:`GroupStats`; ``grad_sync``: how gradients were reduced and how often."""

    system: str
    loss: float
    placement: Placement
    dp_rank: int
    groups: list[GroupStats] = field(default_factory=list)
    exchange: dict[str, int] = field(default_factory=dict)
    grad_sync: dict = field(default_factory=dict)
    time_s: float = math.nan

    @property
    def phase_times(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for g in self.groups:
            for k, v in g.phase_times.items():
                out[k] = out.get(k, 0.0) + v
        return out


def _lockstep(placement: Placement, microbatch: int | None) -> bool:
    """Whether every DP rank runs the same sequence of forwards and backwards (ZeRO-3 can then run)."""

    def shape(ws: list[Work]):
        return [
            (len(w.responses) if microbatch is None else math.ceil(len(w.responses) / microbatch)) for w in ws
        ]

    if placement.split_groups:
        return False
    first = shape(placement.work[0])
    return all(shape(ws) == first for ws in placement.work)


def train_step(
    model: nn.Module,
    groups: list[RolloutGroup],
    *,
    system: str = "prefixflow",
    layout: str = "padded",
    microbatch: int | None = None,
    loss: str = "pg",
    loss_config=None,
    split_threshold: float | None = 0.25,
    observer=None,
) -> StepStats:
    """Train one optimizer step's ``groups`` across the model's DP ranks and reduce the gradients once.

    Every rank passes the same groups (all ranks compute the same placement). On a model without
    ``parallelize`` this trains every group locally. Accumulates into ``param.grad``; no optimizer step.
    """
    if not groups:
        raise ValueError("train_step needs at least one group")
    if microbatch == "auto":
        raise ValueError(
            "microbatch='auto' (sized to a memory budget) runs in train_group on one process; "
            "train_step needs an int microbatch or None"
        )
    state = parallel_state(model)
    n_ranks = state.dims.batch if state is not None else 1
    me = state.coordinate("batch") if state is not None and n_ranks > 1 else 0
    costs = [group_costs(model, g, system) for g in groups]
    ep = state is not None and state.dims.ep > 1
    # Under EP groups stay whole: a split group's owner alone runs Phase A and C, out of the EP lockstep.
    placement = place_groups(costs, n_ranks, None if ep else split_threshold)
    if ep and not _lockstep(placement, microbatch):
        raise ValueError(
            f"ep={state.dims.ep}: the EP ranks run their MoE all-to-alls in lockstep, so every DP rank must "
            "train the same sequence of microbatches; give each rank as many groups, of the same sizes"
        )
    exchange = PrefixExchange(state.peers("batch") if n_ranks > 1 else [0])
    fsdp_on = state is not None and state.fsdp
    if fsdp_on:
        fsdp_mod.reset_collective_counts(model)
        zero3 = _lockstep(placement, microbatch)
        sync = fsdp_mod.accumulate_groups(model) if zero3 else fsdp_mod.gathered_for_step(model)
        mode = "fsdp-zero3" if zero3 else "fsdp-gathered"
    else:
        sync, mode = contextlib.nullcontext(), "all-reduce" if n_ranks > 1 else "none"
    kwargs = dict(
        system=system,
        layout=layout,
        microbatch=microbatch,
        loss=loss,
        loss_config=loss_config,
        observer=observer,
    )
    stats = StepStats(system, math.nan, placement, me)
    start = time.perf_counter()
    with sync:
        for work in placement.work[me]:
            if work.split:
                stats.groups.append(
                    _train_split_part(model, groups[work.group], work, me, exchange, **kwargs)
                )
            else:
                stats.groups.append(train_group(model, groups[work.group], **kwargs))
    all_reduces = 0
    if mode == "all-reduce":
        all_reduces = all_reduce_gradients(model, state.mesh["dp_replicate"].get_group())
    stats.time_s = time.perf_counter() - start
    local = torch.tensor([sum(g.loss for g in stats.groups)], dtype=torch.float64)
    if n_ranks > 1:
        dist.all_reduce(local, group=state.mesh["batch"].get_group())
    stats.loss = float(local)
    keys = ("kv_bytes", "grad_kv_bytes", "header_bytes", "expected_kv_bytes", "expected_grad_kv_bytes")
    counts = torch.tensor([getattr(exchange, k) for k in keys], dtype=torch.int64)
    if n_ranks > 1:  # each transfer is counted once, by the rank that sends (or receives) it
        dist.all_reduce(counts, group=state.mesh["batch"].get_group())
    stats.exchange = dict(zip(keys, counts.tolist(), strict=True))
    stats.grad_sync = {"mode": mode, "all_reduces": all_reduces}
    if fsdp_on:
        counts = fsdp_mod.collective_counts(model)
        stats.grad_sync.update(
            units=fsdp_mod.n_units(model),
            reduce_scatters=sum(counts["reduce_scatter"].values()),
            max_reduce_scatters_per_unit=max(counts["reduce_scatter"].values(), default=0),
            all_gathers=sum(counts["all_gather"].values()),
        )
    return stats
