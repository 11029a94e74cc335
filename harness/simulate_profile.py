"""Per-layer costs profiled in one process: block-level forward/backward times of a ``train_group``.

These are the costs of the blocks run alone. Under PP on a shared machine a stage's operations run slower
(the ranks share the cores), which is why the simulator's check against measured cells calibrates on other
measured runs' stage timelines instead (``harness/simulate_validate.py``).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

from harness.simulate import LayerCosts

__all__ = ["profile_layers"]


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
