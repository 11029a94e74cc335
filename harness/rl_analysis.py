"""What Claim 2 derives from its runs: weight divergence between runs, frozen-trace replay records, and the
Claim-3 style reference timing of ``train_group`` alone at the loop's P, S and N."""

from __future__ import annotations

import socket
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from harness.rl_io import load_tensors
from harness.rl_loop import model_overrides, task_of
from harness.rl_spec import RLSpec
from harness.rl_trace import load_trace, replay_trace
from harness.runner import git_rev

__all__ = ["divergence_records", "replay_records", "claim3_reference_records"]


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def divergence_records(spec, folder, plans, init, base) -> list[dict[str, Any]]:
    """RMSE between two runs' weights at each common checkpoint, and each run's drift from the warm start."""
    main = f"baseline-s{spec.seed}"
    pairs = [(main, p.name) for p in plans if p.role == "compare" and p.name != main]
    pairs += [(main, p.name) for p in plans if p.role == "reference"]
    rows = []
    for a, b in pairs:
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
                top = max(top, float((x - y).abs().max()))
                n += x.numel()
            step = int(path.stem.split("_")[1])
            rmse, drift_a, drift_b = (sq / n) ** 0.5, (sa / n) ** 0.5, (sb / n) ** 0.5
            kind = "reference" if b.startswith("baseline-") else "cross-system"
            rows.append(
                {
                    **base,
                    "record_kind": "rl_divergence",
                    "system": b.split("-")[0],
                    "run": b,
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
):
    """Replay one trace with ``system`` (``fp64``: in float64, see :func:`replay_trace`); the rows of
    ``replay-<trace>-<system>[-fp64].parquet``."""
    trace = load_trace(trace_dir)
    m = trace.manifest
    base = dict(
        base or {"spec": "replay", "status": "ok", "git_rev": git_rev(), "host": socket.gethostname()}
    )

    rows = replay_trace(trace, system, device, fp64=fp64)
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
    """``train_group`` alone, Claim 3's way (``harness.runner.run_cell``: fresh models, warm repeats, systems
    alternating), at the loop's P, S and N; measured after loop step ``step``, under the loop's machine load.

    ``suffix_len``: the S the loop's trainers actually ran (the padded layout pads each group to its longest
    sampled response), so the reference times the same token slots; None: the task's answer length."""
    from harness.runner import run_cell
    from harness.spec import Cell, ModelSpec

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
    )
    rows = run_cell(cell)
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
