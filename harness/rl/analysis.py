"""What Claim 2 derives from its runs: weight divergence between runs, frozen-trace replay records, and the
Claim-3 style reference timing of ``train_group`` alone at the loop's P, S and N."""

from __future__ import annotations

import math
import socket
import statistics
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from harness.records import read_records
from harness.rl.io import load_tensors, write_rl_records
from harness.rl.loop import RunPlan, model_overrides, task_of
from harness.rl.spec import RLSpec
from harness.rl.trace import load_trace, nan_max, replay_trace
from harness.run.columns import git_rev

__all__ = [
    "pair_kind",
    "run_pairs",
    "divergence_records",
    "replay_records",
    "claim3_reference_records",
    "Claim3Reference",
]


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def pair_kind(a: RunPlan, b: RunPlan) -> str:
    """``seed-change`` (one trainer, two sampling seeds), ``cross-system`` (two trainers, one seed: their
    rollouts fork only where rounding flips a sampled token) or ``cross-system+seed`` (two trainers, two
    seeds: rollouts forked from the first step, the paper's closed-loop condition)."""
    if a.system == b.system:
        return "seed-change"
    return "cross-system" if a.seed == b.seed else "cross-system+seed"


def run_pairs(plans: list[RunPlan]) -> list[tuple[RunPlan, RunPlan]]:
    """Every pair of closed-loop runs (compared and reference), the baseline first in a cross-system pair."""
    runs = [p for p in plans if p.role in ("compare", "reference")]
    pairs = []
    for i, a in enumerate(runs):
        for b in runs[i + 1 :]:
            pairs.append((b, a) if a.system != "baseline" and b.system == "baseline" else (a, b))
    return pairs


def divergence_records(spec, folder, plans, init, base) -> list[dict[str, Any]]:
    """RMSE between two runs' weights at each common checkpoint, and each run's drift from the warm start,
    for every pair of :func:`run_pairs` (kinds: :func:`pair_kind`)."""
    rows = []
    for plan_a, plan_b in run_pairs(plans):
        a, b = plan_a.name, plan_b.name
        da, db = (
            folder / "_state" / "runs" / a / "checkpoints",
            folder / "_state" / "runs" / b / "checkpoints",
        )
        for path in sorted(da.glob("step_*.safetensors")):
            other = db / path.name
            if not other.exists():
                continue
            wa, wb = load_tensors(path)[0], load_tensors(other)[0]
            n = sq = sa = sb = 0.0
            top = 0.0
            for name, w0 in init.items():
                x, y, z = wa[name].double(), wb[name].double(), w0.double()
                sq += float((x - y).pow(2).sum())
                sa += float((x - z).pow(2).sum())
                sb += float((y - z).pow(2).sum())
                top = nan_max(top, float((x - y).abs().max()))
                n += x.numel()
            step = int(path.stem.split("_")[1])
            rmse, drift_a, drift_b = (sq / n) ** 0.5, (sa / n) ** 0.5, (sb / n) ** 0.5
            kind = pair_kind(plan_a, plan_b)
            rows.append(
                {
                    **base,
                    "record_kind": "rl_divergence",
                    "system": plan_b.system,
                    "run": f"{a}~{b}",  # one row per pair and step
                    "run_a": a,
                    "run_b": b,
                    "pair": kind,
                    "step": step,
                    "rmse": rmse,
                    "max_abs": top,
                    "drift_a": drift_a,
                    "drift_b": drift_b,
                    "rmse_over_drift_a": rmse / drift_a if drift_a else None,
                    "rmse_over_drift_b": rmse / drift_b if drift_b else None,
                    "dtype": spec.loop.dtype,
                    "timestamp": _now(),
                }
            )
    return rows


def replay_records(
    trace_dir: Path,
    system: str,
    device,
    base: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
    fp64: bool = False,
    ranks=None,
):
    """Replay one trace with ``system`` (``fp64``: in float64; ``ranks``: on the loop's parallel layout; see
    :func:`replay_trace`); the rows of ``replay-<trace>-<system>[-fp64].parquet``."""
    trace = load_trace(trace_dir)
    m = trace.manifest
    base = dict(
        base or {"spec": "replay", "status": "ok", "git_rev": git_rev(), "host": socket.gethostname()}
    )

    rows = replay_trace(trace, system, device, fp64=fp64, ranks=ranks)
    last = rows[-1]
    log(
        f"replay {trace.name} with {system}{' in fp64' if fp64 else ''}: after step {last['step']} max|dW| {last['max_abs']:.3e} "
        f"(rel {last['max_rel']:.2e}) rmse {last['rmse']:.2e}, tau rule {'pass' if all(r['tau_pass'] for r in rows) else 'FAIL'}"
    )
    return [
        {
            **base,
            "record_kind": "rl_replay",
            "trace": trace.name,
            "source_system": m.system,
            "system": system,
            "dtype": m.dtype,
            "model": m.model,
            "seed": m.seed,
            "device": torch.device(device).type,
            "timestamp": _now(),
            **r,
        }
        for r in rows
    ]


def claim3_reference_records(
    spec: RLSpec, device: torch.device, base: dict[str, Any], step: int, suffix_len: int | None = None
) -> list[dict[str, Any]]:
    """``train_group`` alone, Claim 3's way (``harness.run.measurement.measure_cell``: fresh models, warm repeats, systems
    alternating), at the loop's P, S and N; measured after loop step ``step``, under the loop's machine load.

    ``suffix_len``: the S the loop's trainers actually ran (the padded layout pads each group to its longest
    sampled response), so the reference times the same token slots; None: the task's answer length.

    On the loop's ranks (a multi-rank ``spec.parallel``) every rank measures, as a multi-rank Claim-3 cell
    does (``harness.run.parallel_step``: the slowest rank's time per step); ranks other than 0 return no rows."""
    from harness.run.measurement import measure_cell
    from harness.spec.cell import Cell, ModelSpec

    task, loop = task_of(spec), spec.loop
    split = loop.attention == "split" or (loop.attention == "auto" and device.type == "cpu")
    system = "prefixflow_split" if split else "prefixflow"
    cell = Cell(
        spec=spec.name,
        model=ModelSpec(name=spec.model.name, overrides=model_overrides(spec, task), label=spec.model.label),
        prefix_len=task.prompt_len,
        suffix_len=suffix_len or task.response_len,
        n=loop.n,
        layout=loop.layout,
        microbatch=loop.microbatch,
        dtype=loop.dtype,
        systems=("baseline", system),
        loss="grpo",
        device=device.type,
        seed=spec.seed,
        warmup=spec.claim3_reference.warmup,
        repeats=spec.claim3_reference.repeats,
        parallel=spec.parallel,
    )
    rows = measure_cell(cell) or []
    keep = {"spec", "preset", "identity"}
    return [
        {
            **r,
            **{k: base[k] for k in keep},
            "record_kind": "rl_claim3_ref",
            "step": step,
            "task_suffix_len": task.response_len,
            "timestamp": _now(),
        }
        for r in rows
    ]


class Claim3Reference:
    """Claim 3's measurement of ``train_group`` alone at the loop's P, S, N, taken at every checkpoint step
    between loop steps (so under the same machine load as the loop), kept in ``claim3-reference.parquet``."""

    def __init__(
        self, spec: RLSpec, folder: Path, device, base: dict[str, Any], log: Callable[[str], None], ranks=None
    ) -> None:
        self.spec, self.device, self.base, self.log, self.ranks = spec, device, base, log, ranks
        self.path = folder / "claim3-reference.parquet"
        self.rows: list[dict[str, Any]] = []

    def resume(self, step: int) -> None:
        if self.path.exists():
            old = read_records(self.path)
            old = old[(old["identity"] == self.base["identity"]) & (old["step"] <= step)]
            self.rows = old.to_dict("records")

    def after(self, step: int, loop_rows: list[dict[str, Any]]) -> None:
        """Measure at checkpoint ``step``, at the suffix length the compared trainers ran since the previous
        measurement (``loop_rows``: their step records; the median of each step's mean padded length)."""
        spec = self.spec
        due = step % spec.checkpoint_every == 0 or step == spec.loop.steps
        if not spec.claim3_reference.enabled or not due or any(r["step"] == step for r in self.rows):
            return
        since = step - spec.checkpoint_every
        padded = [r.get("padded_suffix_len_mean", math.nan) for r in loop_rows if since < r["step"] <= step]
        padded = [v for v in padded if v == v]  # records from before the column existed hold NaN
        suffix_len = round(statistics.median(padded)) if padded else None
        new = claim3_reference_records(spec, self.device, self.base, step, suffix_len)
        if self.ranks is not None:
            new = self.ranks.from_main(new)  # the merged records are rank 0's
        self.rows += new
        write_rl_records(self.path, self.rows, self.path.parent)
        t = {r["system"]: r.get("step_time_s", math.nan) for r in self.rows[-2:]}
        ratio = t.get("baseline", float("nan")) / min(v for k, v in t.items() if k != "baseline")
        self.log(f"claim-3 reference at step {step}: train_group alone {ratio:.2f}x")
