"""Discrete-event model of PrefixFlow's pipeline schedules and of CP prefix-K/V communication.

The model is driven by per-layer costs. Those come either from a measurement on this machine
(:func:`profile_layers`: block-level forward/backward times of a single-process ``train_group``) or from
``harness.costmodel`` FLOPs at an assumed throughput (:func:`flop_layer_costs`, for paper-scale panels, which
are labelled simulated).

- **PP** (:func:`simulate_pipeline`): every stage runs :func:`prefixflow.parallel.pp.stage_program`, the same
  operation order the real schedule runs. An operation starts when its stage is free and its input has
  arrived: ``A``/``F m`` after the previous stage's ``A``/``F m`` plus one message, ``B m``/``C`` after the next
  stage's ``B m``/``C`` plus one message; a barrier releases every stage when the last arrives. Sends never
  block (the real schedule's ``isend``).
- **CP** (:func:`simulate_cp_phase_b`): per suffix microbatch and layer, the prefix gather of layer ``l+1`` is
  issued when layer ``l`` reads its view and overlaps layer ``l``'s compute; layer 0 gathers on demand; gK/gV
  reduce-scatters in the backward block. Without prefetch every gather is exposed.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field

from harness import costmodel

__all__ = [
    "PipelineCosts",
    "SimResult",
    "simulate_pipeline",
    "pipeline_costs",
    "LayerCosts",
    "profile_layers",
    "flop_layer_costs",
    "simulate_cp_phase_b",
    "relative_error",
]


@dataclass
class PipelineCosts:
    """Seconds of every stage operation. ``forward[s][m]``/``backward[s][m]`` per microbatch ``m``;
    ``prefix_forward[s]``/``prefix_backward[s]`` (0 without a prefix); ``message[m]``/``prefix_message``: one
    activation (or gradient) transfer between neighbouring stages; ``barrier``: a global barrier's cost."""

    forward: list[list[float]]
    backward: list[list[float]]
    prefix_forward: list[float]
    prefix_backward: list[float]
    message: list[float]
    prefix_message: float = 0.0
    barrier: float = 0.0

    @property
    def n_stages(self) -> int:
        return len(self.forward)

    @property
    def n_microbatches(self) -> int:
        return len(self.message)


@dataclass
class SimResult:
    span_s: float
    timelines: list[list[dict]] = field(default_factory=list)

    @property
    def bubbles(self) -> list[float]:
        return [
            self.span_s - sum(e["end"] - e["start"] for e in events if e["op"] != "barrier")
            for events in self.timelines
        ]


def simulate_pipeline(costs: PipelineCosts, switching: str, prefix: bool = True) -> SimResult:
    """Replay the stage programs of ``switching`` ("stage_local" or "barrier") over ``costs``."""
    from prefixflow.parallel.pp import stage_program

    n, m = costs.n_stages, costs.n_microbatches
    programs = [stage_program(switching, n, s, m, prefix) for s in range(n)]
    pos, free = [0] * n, [0.0] * n
    ends: dict[tuple, float] = {}
    timelines: list[list[dict]] = [[] for _ in range(n)]
    arrived: dict[int, dict[int, float]] = defaultdict(dict)  # barrier k -> {stage: arrival}
    passed = [0] * n
    while any(pos[s] < len(programs[s]) for s in range(n)):
        progress = False
        for s in range(n):
            while pos[s] < len(programs[s]):
                op = programs[s][pos[s]]
                if op[0] == "barrier":
                    k = passed[s]
                    arrived[k].setdefault(s, free[s])
                    if len(arrived[k]) < n:
                        break
                    release = max(arrived[k].values()) + costs.barrier
                    timelines[s].append(
                        dict(stage=s, op="barrier", mb=None, wait=free[s], start=release, end=release)
                    )
                    free[s], passed[s] = release, k + 1
                    pos[s] += 1
                    progress = True
                    continue
                ready = _input_ready(op, s, n, ends, costs)
                if ready is None:
                    break
                start = max(free[s], ready)
                end = start + _cost(op, s, costs)
                key = (op[0], s, op[1] if len(op) > 1 else None)
                ends[key] = end
                timelines[s].append(dict(stage=s, op=op[0], mb=key[2], wait=free[s], start=start, end=end))
                free[s] = end
                pos[s] += 1
                progress = True
        if not progress:
            raise RuntimeError("pipeline simulation deadlocked (inconsistent stage programs)")
    return SimResult(max(free), timelines)


def _input_ready(op: tuple, s: int, n: int, ends: dict, costs: PipelineCosts) -> float | None:
    kind = op[0]
    mb = op[1] if len(op) > 1 else None
    if kind in ("A", "F"):
        if s == 0:
            return 0.0
        dep = ends.get((kind, s - 1, mb))
        msg = costs.prefix_message if kind == "A" else costs.message[mb]
    else:  # "B", "C": gradients come back from the next stage
        if s == n - 1:
            return 0.0
        dep = ends.get((kind, s + 1, mb))
        msg = costs.prefix_message if kind == "C" else costs.message[mb]
    return None if dep is None else dep + msg


def _cost(op: tuple, s: int, costs: PipelineCosts) -> float:
    kind = op[0]
    if kind == "A":
        return costs.prefix_forward[s]
    if kind == "C":
        return costs.prefix_backward[s]
    return (costs.forward if kind == "F" else costs.backward)[s][op[1]]


# --- per-layer costs ---------------------------------------------------------------------------------------


@dataclass
class LayerCosts:
    """Seconds per layer of each operation of one group: ``prefix_forward[l]``, ``prefix_backward[l]``,
    ``forward[m][l]``/``backward[m][l]`` per microbatch; ``head_forward[m]``/``head_backward[m]``: the LM head
    and loss; ``source``: ``"measured"`` or ``"flops"``."""

    prefix_forward: list[float]
    prefix_backward: list[float]
    forward: list[list[float]]
    backward: list[list[float]]
    head_forward: list[float]
    head_backward: list[float]
    source: str = "measured"

    @property
    def n_layers(self) -> int:
        return len(self.prefix_forward) if self.prefix_forward else len(self.forward[0])


def pipeline_costs(
    layers: LayerCosts,
    stages: list[list[int]],
    *,
    message_s: list[float] | float = 0.0,
    prefix_message_s: float = 0.0,
    barrier_s: float = 0.0,
) -> PipelineCosts:
    """Sum each stage's layers (``stages[s]``: its layer indices); the LM head goes to the last stage."""
    n_mb = len(layers.forward)
    last = len(stages) - 1

    def stage_sum(per_layer: list[float], s: int) -> float:
        return sum(per_layer[i] for i in stages[s]) if per_layer else 0.0

    fwd = [
        [
            stage_sum(layers.forward[m], s) + (layers.head_forward[m] if s == last else 0.0)
            for m in range(n_mb)
        ]
        for s in range(len(stages))
    ]
    bwd = [
        [
            stage_sum(layers.backward[m], s) + (layers.head_backward[m] if s == last else 0.0)
            for m in range(n_mb)
        ]
        for s in range(len(stages))
    ]
    msgs = message_s if isinstance(message_s, list) else [float(message_s)] * n_mb
    return PipelineCosts(
        forward=fwd,
        backward=bwd,
        prefix_forward=[stage_sum(layers.prefix_forward, s) for s in range(len(stages))],
        prefix_backward=[stage_sum(layers.prefix_backward, s) for s in range(len(stages))],
        message=msgs,
        prefix_message=prefix_message_s,
        barrier=barrier_s,
    )


class _Profiler:
    """Block-level timers for one ``train_group`` call. A block's forward is timed by forward hooks (a block
    that Phase A stops inside ends when the phase does). Its backward ends when the gradient of its input is
    ready and starts when the unit above it finished (the LM head's output gradient, or Phase C's start).
    Operations are keyed by the phase and microbatch of their forward (a ScheduleHooks the schedule enters)."""

    def __init__(self, model) -> None:
        from prefixflow.hooks import ScheduleHooks

        self.phase, self.mb, self.count = None, None, 0
        self.fwd: dict[tuple, float] = {}
        self.grad_in: dict[tuple, float] = {}
        self.grad_out: dict[tuple, float] = {}
        self.pending: dict[int, tuple] = {}
        self.wall: dict[tuple, float] = {}  # (phase, mb) -> seconds of the whole operation
        self.c_start = 0.0
        self.head = len(model.layers)
        profiler = self

        class Marks(ScheduleHooks):
            @contextlib.contextmanager
            def phase(self, name):
                profiler.phase = name
                start = time.perf_counter()
                if name == "C":
                    profiler.c_start = start
                try:
                    yield
                finally:
                    now = time.perf_counter()
                    for key, t0 in profiler.pending.values():
                        profiler.fwd[key] = now - t0
                    profiler.pending.clear()
                    profiler.wall[(name, None)] = now - start

            @contextlib.contextmanager
            def microbatch(self, mb):
                profiler.mb = profiler.count
                profiler.count += 1
                start = time.perf_counter()
                try:
                    yield
                finally:
                    profiler.wall[(profiler.phase, profiler.mb)] = time.perf_counter() - start
                    profiler.mb = None

        self.hook = Marks()
        units = [*model.layers.values(), model.output]
        self.handles = []
        for i, unit in enumerate(units):
            self.handles.append(unit.register_forward_pre_hook(self._pre(i)))
            self.handles.append(unit.register_forward_hook(self._post(i)))

    def _pre(self, i):
        def hook(module, args):
            key = (self.phase, self.mb, i)
            self.pending[i] = (key, time.perf_counter())
            x = args[0]
            if x.requires_grad:
                x.register_hook(lambda g: self.grad_in.__setitem__(key, time.perf_counter()))

        return hook

    def _post(self, i):
        def hook(module, args, out):
            key, t0 = self.pending.pop(i)
            self.fwd[key] = time.perf_counter() - t0
            if i == self.head and out.requires_grad:
                out.register_hook(lambda g: self.grad_out.__setitem__(key, time.perf_counter()))

        return hook

    def records(self) -> dict[tuple, float]:
        """``{(phase, mb, unit, "fwd"|"bwd"): seconds}``, and ``{(phase, mb, "wall"): seconds}`` per operation."""
        out = {(*k, "wall"): v for k, v in self.wall.items()}
        out.update({(*k, "fwd"): v for k, v in self.fwd.items()})
        ops = {k[:2] for k in self.grad_in}
        for phase, mb in ops:
            units = sorted((k[2] for k in self.grad_in if k[:2] == (phase, mb)), reverse=True)
            prev = self.grad_out.get((phase, mb, self.head), self.c_start)
            for u in units:
                t = self.grad_in[(phase, mb, u)]
                out[(phase, mb, u, "bwd")] = t - prev
                prev = t
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def profile_layers(
    model, group, *, system: str = "prefixflow", layout: str = "padded", microbatch=None, repeats: int = 3
) -> LayerCosts:
    """Measured per-layer costs: median block forward/backward times of a single-process ``train_group``
    (after one warm-up), per operation of the group. Phase C's recomputation (AC) counts as backward."""
    import statistics

    from prefixflow import add_hooks, remove_hooks, train_group

    runs = []
    for it in range(repeats + 1):
        prof = _Profiler(model)
        add_hooks(model, prof.hook)
        try:
            model.zero_grad(set_to_none=True)
            train_group(model, group, system=system, layout=layout, microbatch=microbatch)
        finally:
            remove_hooks(model, prof.hook)
            prof.close()
        if it:
            runs.append(prof.records())
    model.zero_grad(set_to_none=True)
    n_layers = len(model.layers)
    table: dict[tuple, list[float]] = defaultdict(list)
    for records in runs:
        for key, seconds in records.items():
            table[key].append(seconds)
    med = {k: statistics.median(v) for k, v in table.items()}
    b = "B" if system == "prefixflow" else "full"
    mbs = sorted({k[1] for k in med if k[0] == b and k[1] is not None})

    def layer_list(phase, mb, kind):
        return [med.get((phase, mb, i, kind), 0.0) for i in range(n_layers)]

    costs = LayerCosts(
        prefix_forward=layer_list("A", None, "fwd") if system == "prefixflow" else [],
        prefix_backward=layer_list("A", None, "bwd") if system == "prefixflow" else [],
        forward=[layer_list(b, m, "fwd") for m in mbs],
        backward=[layer_list(b, m, "bwd") for m in mbs],
        head_forward=[med.get((b, m, n_layers, "fwd"), 0.0) for m in mbs],
        head_backward=[med.get((b, m, n_layers, "bwd"), 0.0) for m in mbs],
    )
    _fold_overheads(costs, med, b)
    return costs


def _fold_overheads(costs: LayerCosts, med: dict, b: str) -> None:
    """Work outside the timed blocks (embedding, final norm, loss, schedule bookkeeping) joins the units next to
    it: a microbatch's goes to its LM head (the last stage), split like the head's own forward/backward;
    Phase A's to the first layer's forward, Phase C's to the first layer's backward (the first stage)."""
    for m in range(len(costs.forward)):
        wall = med.get((b, m, "wall"))
        if wall is None:
            continue
        units = (
            sum(costs.forward[m]) + sum(costs.backward[m]) + costs.head_forward[m] + costs.head_backward[m]
        )
        extra = max(0.0, wall - units)
        head = costs.head_forward[m] + costs.head_backward[m]
        share = costs.head_forward[m] / head if head > 0 else 1 / 3
        costs.head_forward[m] += share * extra
        costs.head_backward[m] += (1 - share) * extra
    for phase, per_layer in (("A", costs.prefix_forward), ("C", costs.prefix_backward)):
        wall = med.get((phase, None, "wall"))
        if wall is not None and per_layer:
            per_layer[0] += max(0.0, wall - sum(per_layer))


def flop_layer_costs(
    shape, P: int, S: int, N: int, *, microbatch: int = 1, flops_per_s: float, tp: int = 1, cp: int = 1
) -> LayerCosts:
    """Per-layer costs from ``harness.costmodel`` FLOPs at ``flops_per_s`` (an assumed sustained throughput),
    with ``tp``/``cp`` dividing every layer's work. Backward = 2x forward. Suffix microbatches of
    ``microbatch`` responses of ``S`` tokens read a ``P-1``-token prefix."""
    shape = costmodel.as_shape(shape)
    split = tp * cp
    p = P - 1

    def fwd(
        tokens: int, pairs: int
    ) -> float:  # one layer's forward FLOPs (GEMMs per token, attention per pair)
        return (tokens * shape.layer + pairs * shape.pair) / flops_per_s / split

    n_mb = -(-N // microbatch)
    sizes = [min(microbatch, N - i * microbatch) for i in range(n_mb)]
    suffix_pairs = S * p + S * (S + 1) // 2
    forward = [[fwd(b * S, b * suffix_pairs)] * shape.n_layers for b in sizes]
    head = [b * S * shape.head / flops_per_s / split for b in sizes]
    return LayerCosts(
        prefix_forward=[fwd(p, p * (p + 1) // 2)] * shape.n_layers,
        prefix_backward=[2 * fwd(p, p * (p + 1) // 2)] * shape.n_layers,
        forward=forward,
        backward=[[2 * x for x in row] for row in forward],
        head_forward=head,
        head_backward=[2 * h for h in head],
        source="flops",
    )


# --- CP ---------------------------------------------------------------------------------------------------


def simulate_cp_phase_b(
    layer_forward: list[float],
    layer_backward: list[float],
    *,
    n_microbatches: int,
    gather_s: float,
    scatter_s: float,
    prefetch: bool,
    other_comm_s: float = 0.0,
    overlap_fraction: float = 1.0,
) -> dict[str, float]:
    """One rank's Phase B under CP: compute, exposed and overlapped prefix-K/V communication, gather counts.

    ``layer_forward``/``layer_backward``: compute seconds of each layer for one suffix microbatch;
    ``gather_s``/``scatter_s``: one prefix-K/V all-gather / gK-gV reduce-scatter; ``other_comm_s``: blocking
    communication per microbatch that prefetch does not touch (the sequence K/V exchange). A prefetched
    gather of layer ``l+1`` is issued as layer ``l`` reads its view and can hide behind ``overlap_fraction`` of
    layer ``l``'s forward compute.
    """
    n_layers = len(layer_forward)
    exposed = overlapped = 0.0
    demand = prefetched = 0
    for _ in range(n_microbatches):
        for layer in range(n_layers):
            if layer == 0 or not prefetch:
                exposed += gather_s
                demand += 1
            else:
                window = overlap_fraction * layer_forward[layer - 1]
                hidden = min(gather_s, window)
                overlapped += hidden
                exposed += gather_s - hidden
                prefetched += 1
        exposed += n_layers * scatter_s
    compute = n_microbatches * (sum(layer_forward) + sum(layer_backward))
    phase_b = compute + exposed + n_microbatches * other_comm_s
    return dict(
        compute_s=compute,
        exposed_s=exposed,
        overlapped_s=overlapped,
        other_comm_s=n_microbatches * other_comm_s,
        phase_b_s=phase_b,
        demand_gathers=demand,
        prefetched_gathers=prefetched,
    )


def relative_error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured if measured else float("inf")
