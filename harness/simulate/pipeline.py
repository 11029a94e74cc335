"""Discrete-event model of PrefixFlow's pipeline schedules and of CP prefix-K/V communication.

The model is driven by per-layer costs. Those come from measured stage timelines
(``harness/simulate/validate.py``) or from ``harness.costmodel.flops`` FLOPs at an assumed throughput (:func:`flop_layer_costs`, for paper-scale panels, which
are labelled simulated).

- **PP** (:func:`simulate_pipeline`): every stage runs :func:`prefixflow.parallel.pp.stage_program`, the same
  operation order the real schedule runs. An operation starts when its stage is free and its input has
  arrived: ``A``/``F m`` after the previous stage's ``A``/``F m`` plus one message, ``B m``/``C`` after the next
  stage's ``B m``/``C`` plus one message; a barrier releases every stage when the last arrives. Sends never
  block (the real schedule's ``isend``). Stages have a core each, or share ``cores`` (processor sharing).
- **CP** (``harness/simulate/cp.py``): per suffix microbatch and layer, the prefix gather of layer ``l+1`` is
  issued when layer ``l`` reads its view and overlaps layer ``l``'s compute; layer 0 gathers on demand; gK/gV
  reduce-scatters in the backward block. Without prefetch every gather is exposed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from harness.costmodel import flops

__all__ = [
    "PipelineCosts",
    "SimResult",
    "simulate_pipeline",
    "pipeline_costs",
    "LayerCosts",
    "flop_layer_costs",
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


def simulate_pipeline(
    costs: PipelineCosts, switching: str, prefix: bool = True, cores: float | None = None
) -> SimResult:
    """Replay the stage programs of ``switching`` ("stage_local" or "barrier") over ``costs``.

    ``cores``: the processors the stages share (None: one each). While more stages compute than there are
    cores, each progresses at ``cores / busy`` of its speed (processor sharing): on a machine with fewer free
    cores than stages, work that overlaps in the schedule does not finish sooner."""
    from prefixflow.parallel.pp import stage_program

    n, m = costs.n_stages, costs.n_microbatches
    programs = [stage_program(switching, n, s, m, prefix) for s in range(n)]
    pos, free = [0] * n, [0.0] * n  # next operation; when the stage finished its last one
    running: dict[int, list] = {}  # stage -> [key, start, seconds of work left]
    ends: dict[tuple, float] = {}
    timelines: list[list[dict]] = [[] for _ in range(n)]
    arrived: dict[int, dict[int, float]] = defaultdict(dict)  # barrier k -> {stage: arrival}
    passed = [0] * n
    now = 0.0
    while any(pos[s] < len(programs[s]) for s in range(n)):
        waiting: list[float] = []  # times at which an input arrives or a barrier releases
        changed = True
        while changed:  # a stage passing a barrier may let one scanned before it start
            changed, waiting = False, []
            for s in range(n):
                while s not in running and pos[s] < len(programs[s]):
                    op = programs[s][pos[s]]
                    if op[0] == "barrier":
                        k = passed[s]
                        arrived[k].setdefault(s, free[s])
                        if len(arrived[k]) < n:
                            break
                        ready = max(arrived[k].values()) + costs.barrier
                    else:
                        ready = _input_ready(op, s, n, ends, costs)
                        if ready is None:
                            break
                    if ready > now:
                        waiting.append(ready)
                        break
                    start = max(free[s], ready)
                    if op[0] == "barrier":
                        timelines[s].append(
                            dict(stage=s, op="barrier", mb=None, wait=free[s], start=start, end=start)
                        )
                        free[s], passed[s] = start, passed[s] + 1
                        pos[s] += 1
                        changed = True
                        continue
                    running[s] = [(op[0], s, op[1] if len(op) > 1 else None), start, _cost(op, s, costs)]
        if not running and not waiting:
            raise RuntimeError("pipeline simulation deadlocked (inconsistent stage programs)")
        rate = 1.0 if cores is None or len(running) <= cores else cores / len(running)
        done = min((left / rate for _, _, left in running.values()), default=float("inf"))
        step = min(done, min(waiting, default=float("inf")) - now)
        now += step
        for s in list(running):
            key, start, left = running[s]
            running[s][2] = left - step * rate
            if left / rate <= step * (1 + 1e-12):  # this operation finished
                end = start + _cost((key[0], key[2]), s, costs) if rate == 1.0 and cores is None else now
                ends[key] = end
                timelines[s].append(dict(stage=s, op=key[0], mb=key[2], wait=free[s], start=start, end=end))
                free[s] = end
                pos[s] += 1
                del running[s]
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


def flop_layer_costs(
    shape, P: int, S: int, N: int, *, microbatch: int = 1, flops_per_s: float, tp: int = 1, cp: int = 1
) -> LayerCosts:
    """Per-layer costs from ``harness.costmodel.flops`` FLOPs at ``flops_per_s`` (an assumed sustained throughput),
    with ``tp``/``cp`` dividing every layer's work. Backward = 2x forward. Suffix microbatches of
    ``microbatch`` responses of ``S`` tokens read a ``P-1``-token prefix."""
    shape = flops.as_shape(shape)
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


def relative_error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured if measured else float("inf")
