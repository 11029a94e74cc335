"""The one measurement loop of every measured cell (a rollout group, a tree, the data-parallel step on one rank
or many), in the shape of benchopt's ``run_one_resolution``: build each system, interleave them, warm up,
repeat, meter, take the rank-max, record.

What differs between cell kinds is a :class:`Bench`: how a system's model is built, the step inputs (one
group, one tree, a step's groups), an optional untimed preparation (a memory budget measured first) and the
untimed columns read after the last timed step (gradient digests). The rules below are the same for all:

* **Interleaved, counterbalanced.** Step ``i`` visits the systems in the cell's order when ``i`` is even and
  in reverse when it is odd (A B, B A, A B, ...): no system always runs first, after a cold cache or a
  neighbour's garbage. Every rank visits them in the same order (collectives meet).
* **Warm-up, then repeats.** ``cell.warmup`` untimed steps (the first one's time is kept: compile time), then
  ``cell.repeats`` timed ones, each under a :class:`~harness.run.measure.PhaseMeter` without the CPU live-bytes
  meter (its per-op cost would distort times; CUDA memory statistics are free).
* **Memory and FLOPs apart from time, and apart from each other.** On CPU one untimed step per system under
  the live-bytes meter gives each phase's peak; then, where the bench counts FLOPs, one more untimed step under
  the FLOP counters. They never share a step: ``FlopCounterMode`` keeps tensors alive that activation
  checkpointing would free, so a peak measured under it overstates AC's memory. ``torch.compile`` cannot run
  under a dispatch mode: compiled cells have neither step. On CUDA the timed steps' allocator peaks are the
  memory.
* **Rank-max.** Each rank keeps its own per-step samples; :func:`merge_ranks` takes, per step, the slowest
  rank's time (the ranks meet at the gradient reduction), the median over steps, and the largest peak.
* **Failures stay with their system.** A system whose build or step raises is recorded with its status
  (``oom`` or ``error``) and traceback; the others go on.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import statistics
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from harness.run.columns import classify
from harness.run.measure import PhaseMeter
from harness.run.progress import report
from harness.spec.cell import Cell

__all__ = ["Bench", "SystemRun", "run_systems", "visit_order", "merge_ranks", "median_step", "cell_records"]

TIMED = ("step_time_s", "phase_a_s", "phase_b_s", "phase_c_s")
MEMORY = ("peak_mem_bytes", "peak_mem_phase_b_bytes", "offloaded_peak_bytes", "offloaded_peak_phase_b_bytes")


@dataclass
class SystemRun:
    """One system of a cell on this rank: what was built and what its steps measured."""

    name: str
    contender: Any = None
    model: torch.nn.Module | None = None
    failure: tuple[str, str] | None = None  # (status, traceback)
    first_step_s: float = math.nan
    samples: list[dict[str, Any]] = field(default_factory=list)  # the timed steps' meter results
    stats: list[Any] = field(default_factory=list)  # the timed steps' ``GroupStats`` (or a peer's)
    memory: dict[str, Any] | None = None  # the metered step's results (CPU)
    counted: Any = None  # the FLOP-counting step's ``Flops``
    inspected: list[dict[str, Any]] = field(default_factory=list)  # ``Bench.inspect`` after each timed step

    def fail(self, exc: BaseException, device: torch.device) -> None:
        self.failure = (classify(exc), traceback.format_exc())
        if self.model is not None:
            self.model.zero_grad(set_to_none=True)
        self.model = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


@contextlib.contextmanager
def collector_paused(paused: bool = True) -> Iterator[None]:
    """Collect garbage first, then keep Python's cycle collector out of the body: a metered step's live bytes
    must not depend on when the collector frees garbage left by earlier work in the process."""
    if not paused:
        yield
        return
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


Step = Callable[[SystemRun, bool], dict[str, Any] | None]


class Bench(Protocol):
    """What a cell kind supplies to :func:`run_systems`."""

    count_flops: bool  # one untimed step per system under the FLOP counters (CPU and CUDA, not compiled)

    def fresh(self, name: str) -> tuple[Any, torch.nn.Module]:
        """The contender ``name`` and its fresh model (the same seed for every system), before any layout is
        applied: an estimate builds it on the meta device and makes it fake here."""

    def parallelized(self, name: str, contender: Any, model: torch.nn.Module) -> tuple[Any, torch.nn.Module]:
        """The contender and ``model`` with the cell's layout applied on this rank (one rank: as they are)."""

    def inputs(self, runs: list[SystemRun]) -> list:
        """The step inputs every system trains on (built after the models: it may need their vocabulary)."""

    def prepare(self, runs: list[SystemRun], step: Step) -> None:
        """Untimed work before the first step (``step(run, track_memory)`` runs one metered step)."""

    def inspect(self, run: SystemRun, last: bool) -> dict[str, Any]:
        """Untimed values read from ``run.model`` right after each timed step, before its gradients are
        cleared (``last``: the cell's last timed step)."""


def visit_order(systems: list[str], step: int) -> list[str]:
    """The systems in the order step ``step`` visits them: as given on even steps, reversed on odd ones."""
    return list(systems) if step % 2 == 0 else list(reversed(systems))


def run_systems(
    cell: Cell, device: torch.device, bench: Bench, memory_only: bool = False
) -> tuple[list[SystemRun], list]:
    """Build, interleave, warm up, repeat and meter every system of ``cell`` on this rank; returns the runs
    and the step inputs. ``memory_only`` (capacity probes): on CPU one metered step per system (its times are
    the samples), on CUDA one step with no warm-up; no FLOP counting."""
    runs = []
    for name in cell.systems:
        run = SystemRun(name)
        report(f"building {name} ({cell.model.display}, {cell.dtype}, {device})")
        try:
            run.contender, run.model = bench.parallelized(name, *bench.fresh(name))
        except Exception as e:
            run.fail(e, device)
        runs.append(run)
    live = [r for r in runs if r.failure is None]
    inputs: list = []
    if live:
        try:
            inputs = bench.inputs(live)
        except Exception as e:
            for run in live:
                run.fail(e, device)

    def step(
        run: SystemRun, track_memory: bool, count: bool = False, timed: bool = False, last: bool = False
    ):
        """One step of ``run``'s system: its meter's results, or None when it failed (then recorded)."""
        from harness.costmodel.flops import count_flops

        model = run.model
        try:
            model.zero_grad(set_to_none=True)
            meter = PhaseMeter(device, model=model, track_memory=track_memory)
            with collector_paused(track_memory), meter:
                train = lambda: run.contender.step(model, inputs, cell, meter)  # noqa: E731
                if count:
                    run.counted, stats = count_flops(train)
                else:
                    stats = train()
            results = meter.results(extended=True)
            if timed:
                run.inspected.append(bench.inspect(run, last))
            model.zero_grad(set_to_none=True)
        except Exception as e:
            run.fail(e, device)
            return None
        return results, stats

    by_name = {r.name: r for r in runs}
    ready = lambda: [r for r in runs if r.failure is None]  # noqa: E731
    if ready():
        bench.prepare(ready(), lambda run, track: (out := step(run, track)) and out[0])
    on_cpu = device.type == "cpu"
    warmup = 0 if memory_only else cell.warmup
    total = (0 if on_cpu else 1) if memory_only else cell.warmup + cell.repeats
    for it in range(total):
        for name in visit_order(cell.systems, it):
            run = by_name[name]
            if run.failure is not None:
                continue
            timed = it >= warmup
            where = f"repeat {it - warmup + 1}/{total - warmup}" if timed else f"warm-up {it + 1}/{warmup}"
            report(f"{where} {name}")
            if (out := step(run, track_memory=False, timed=timed, last=it == total - 1)) is None:
                continue
            if it == 0:
                run.first_step_s = out[0]["step_time_s"]
            if timed:
                run.samples.append(out[0])
                run.stats.append(out[1])
    compiled = bool(cell.compile)
    if on_cpu and not compiled:
        for run in ready():
            report(f"memory step {run.name} (untimed)")
            if (out := step(run, track_memory=True)) is not None:
                run.memory = out[0]
                if memory_only:  # the probe's only step: its times were taken under the meter
                    run.samples, run.stats = [out[0]], [out[1]]
    if bench.count_flops and not memory_only and not compiled:
        for run in ready():
            report(f"FLOP-counting step {run.name} (untimed)")
            step(run, track_memory=False, count=True)
    return runs, inputs


def median_step(samples: list[dict[str, Any]]) -> int:
    """Index of the timed step with the median step time (the lower middle one for an even count)."""
    order = sorted(range(len(samples)), key=lambda i: samples[i]["step_time_s"])
    return order[(len(order) - 1) // 2]


def _finite(values) -> list[float]:
    return [float(v) for v in values if v is not None and not math.isnan(float(v))]


def _median(values) -> float:
    finite = _finite(values)
    return statistics.median(finite) if finite else math.nan


def _max(values) -> float:
    finite = _finite(values)
    return max(finite) if finite else math.nan


def _spread(values) -> float:
    finite = _finite(values)
    if not finite or max(finite) <= 0:
        return math.nan
    return (max(finite) - min(finite)) / max(finite)


def _per_rank(values: list[float]) -> str:
    return json.dumps([None if math.isnan(v) else v for v in values])


def merge_ranks(per_rank: list[list[dict[str, Any]]], per_rank_columns: bool = True) -> list[dict[str, Any]]:
    """The cell's records from every rank's (rank 0's columns first). Each rank's record carries its timed
    ``samples`` and, on CPU, its metered step's ``memory``. Timed columns: per step the slowest rank's value,
    then the median over steps (``step_time_min_s``/``max_s``: the extremes of the per-step maxima). Memory:
    the largest peak over ranks (from the metered step on CPU, the timed steps on CUDA), of the step and of
    each phase the step metered (``peak_mem_phase_<a|b|c|full>_bytes``). With
    ``per_rank_columns``, each rank's own median (``<col>_per_rank``, JSON) and their spread
    ``(max - min) / max`` too. A system that failed on any rank is failed with that rank's error."""
    merged = []
    for i, rec in enumerate(per_rank[0]):
        rows = [ranks[i] for ranks in per_rank]
        out = {k: v for k, v in rec.items() if k not in ("samples", "memory", "rank")}
        bad = next((r for r in rows if r.get("status") != "ok"), None)
        if bad is not None:
            out["status"], out["error"] = bad["status"], bad.get("error")
            for col in (*TIMED, *MEMORY, "step_time_min_s", "step_time_max_s"):
                out.pop(col, None)
            merged.append(out)
            continue
        steps = min(len(r["samples"]) for r in rows)
        for col in TIMED:
            per_step = [_max(r["samples"][s].get(col) for r in rows) for s in range(steps)]
            out[col] = _median(per_step)
            if col == "step_time_s":
                out["step_time_min_s"], out["step_time_max_s"] = min(per_step), max(per_step)
            if per_rank_columns:
                own = [_median(r["samples"][s].get(col) for s in range(steps)) for r in rows]
                out[f"{col}_per_rank"], out[f"{col}_spread"] = _per_rank(own), _spread(own)
        sources = [[r["memory"]] if r.get("memory") else r["samples"][:steps] for r in rows]
        meter = sources[0][0].get("mem_meter", "none") if sources[0] else "none"
        out["mem_meter"] = meter
        for col in MEMORY:
            own = [_max(s.get(col) for s in src) for src in sources]
            if meter == "none" and col not in ("peak_mem_bytes", "peak_mem_phase_b_bytes"):
                continue
            out[col] = _max(own)
            if per_rank_columns and col in ("peak_mem_bytes", "peak_mem_phase_b_bytes"):
                out[f"{col}_per_rank"], out[f"{col}_spread"] = _per_rank(own), _spread(own)
        if meter != "none":  # every phase's peak (A, B, C, the baseline's full step), the largest over ranks
            phases = {p for src in sources for s in src for p in s.get("phase_peak_bytes", {})}
            for phase in sorted(phases):
                peak = _max(s.get("phase_peak_bytes", {}).get(phase) for src in sources for s in src)
                out[f"peak_mem_phase_{phase.lower()}_bytes"] = float(peak)
        if "first_step_s" in rec:
            out["first_step_s"] = _max(r.get("first_step_s") for r in rows)
        merged.append(out)
    return merged


def cell_records(
    cell: Cell, per_rank: list[list[dict[str, Any]]], per_rank_columns: bool
) -> list[dict[str, Any]]:
    """:func:`merge_ranks`, with the reason a compiled CPU cell has no memory columns."""
    records = merge_ranks(per_rank, per_rank_columns)
    for rec in records:
        if rec.get("mem_meter") == "none" and cell.compile:
            rec["mem_meter"] = "none (torch.compile cannot run under the CPU live-bytes meter)"
    return records
