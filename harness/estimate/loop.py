"""The estimate's loop: :func:`harness.run.loop.run_systems`' build, inputs, preparation, memory step and
FLOP-counting step, under the cell's fake mode, with no timed steps (a fake step's time is no device's)."""

from __future__ import annotations

import time

import torch

from harness.costmodel.counting import count_flops
from harness.costmodel.roofline import RooflineTimer
from harness.estimate.fake import (
    FakePhaseMeter,
    RealTensorGuard,
    fail,
    fake_mode,
    materialise,
    real_limit,
    use_fake_tier,
)
from harness.run.loop import Bench, SystemRun, collector_paused
from harness.run.progress import report
from harness.spec.cell import Cell
from prefixflow.schedule.host import on_host

__all__ = ["FakeBuild", "estimate_systems"]

META = torch.device("meta")


class FakeBuild:
    """A cell kind's :class:`~harness.run.loop.Bench` with its models built on the meta device and
    materialised as fake tensors, and its inputs (the group, the tree) made on the host, real."""

    def __init__(self, bench: Bench, mode) -> None:
        self.bench, self.mode = bench, mode
        self.count_flops = bench.count_flops

    def fresh(self, name: str):
        device, self.bench.device = self.bench.device, META
        try:
            with on_host(), torch.device("meta"):  # meta tensors, outside the fake mode; then made fake
                contender, model = self.bench.fresh(name)
        finally:
            self.bench.device = device
        materialise(model, self.mode)
        use_fake_tier(model)
        return contender, model

    def parallelized(self, name: str, contender, model):
        # under the mode: DTensor shards, FSDP's padded shards and hooks are fake too
        return self.bench.parallelized(name, contender, model)

    def inputs(self, runs: list[SystemRun]) -> list:
        with on_host():
            return self.bench.inputs(runs)

    def prepare(self, runs: list[SystemRun], step) -> None:
        self.bench.prepare(runs, step)

    def inspect(self, run: SystemRun, last: bool) -> dict:
        return {}


def estimate_systems(cell: Cell, device: torch.device, bench: Bench, memory_only: bool = False):
    """:func:`~harness.run.loop.run_systems`' signature and result: per system one metered step (its
    ``memory`` and only ``samples``, times NaN) and, where the bench counts FLOPs and not ``memory_only``, one
    FLOP-counting step, all on fake tensors. A failure stays with its system (``SystemRun.failure``)."""
    mode = fake_mode()
    fake = FakeBuild(bench, mode)
    tokens = (cell.n or 1) * (cell.prefix_len + cell.suffix_len) + cell.prefix_len  # the baseline's and P
    guard = RealTensorGuard(real_limit(tokens))
    runs = []
    with mode, guard:
        for name in cell.systems:
            run = SystemRun(name)
            report(f"building {name} on fake tensors ({cell.model.display}, {cell.dtype})")
            try:
                run.contender, run.model = fake.parallelized(name, *fake.fresh(name))
            except ValueError as e:  # the model cannot take the layout (a TP degree, tied embeddings under PP)
                fail(run, e, cell, device)
                run.failure = ("error", f"cell {cell.cell_id}: {name}: {e}")
            except Exception as e:
                fail(run, e, cell, device)
            runs.append(run)
        live = [r for r in runs if r.failure is None]
        inputs: list = []
        if live:
            try:
                inputs = fake.inputs(live)
            except Exception as e:
                for run in live:
                    fail(run, e, cell, device)

        def step(run: SystemRun, count: bool = False):
            model = run.model
            try:
                model.zero_grad(set_to_none=True)
                meter = FakePhaseMeter(None if count else model)
                started = time.perf_counter()
                with collector_paused(not count), meter:
                    train = lambda: run.contender.step(model, inputs, cell, meter)  # noqa: E731
                    if count:  # the same ops modelled on the H20 (harness.costmodel.roofline)
                        with RooflineTimer() as roofline:
                            run.counted, stats = count_flops(train)
                    else:
                        stats = train()
                results = meter.results(extended=True)
                results["estimate_s"] = time.perf_counter() - started
                if count:
                    results |= {"modelled_time_s": roofline.seconds, "modelled_bytes": roofline.bytes}
                model.zero_grad(set_to_none=True)
            except Exception as e:
                fail(run, e, cell, device)
                return None
            return results, stats

        ready = lambda: [r for r in runs if r.failure is None]  # noqa: E731
        if ready():
            fake.prepare(ready(), lambda run, track: (out := step(run)) and out[0])
        for run in ready():
            report(f"estimate {run.name}: metered step")
            if (out := step(run)) is not None:
                run.memory = out[0]
                run.samples, run.stats = [out[0]], [out[1]]
        if fake.count_flops and not memory_only:
            for run in ready():
                report(f"estimate {run.name}: FLOP-counting step")
                if (out := step(run, count=True)) is not None and run.memory is not None:
                    run.memory["modelled_time_s"] = out[0]["modelled_time_s"]
                    run.memory["modelled_bytes"] = out[0]["modelled_bytes"]
    return runs, inputs
