"""``pf-bench rl``: warm start, the closed-loop runs in lockstep, weight divergence, trace replays, and the
Claim-3 reference measurement, all resumable, into ``OUT/<spec>/<preset>/``::

    records/<run>.parquet            one row per step of each run (record_kind rl_step)
    divergence.parquet               cross-run weight RMSE and each run's drift per checkpoint (rl_divergence)
    replay-<trace>-<system>.parquet  frozen-trace replay, one row per step (rl_replay)
    claim3-reference.parquet         train_group alone at the loop's P, S, N (rl_claim3_ref)
    _state/                          warm start, checkpoints, resume states, traces (safetensors + JSON)

Runs step in lockstep (step t of every run before step t+1 of any), so every trainer is timed under the same
machine load. A killed run resumes from its last checkpoint and reproduces the same numbers.
"""

from __future__ import annotations

import gc
import json
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist

from harness.records import read_records
from harness.rl.analysis import Claim3Reference, divergence_records, replay_records
from harness.rl.io import (
    TraceError,
    save_tensors,
    write_json,
    write_rl_records,
)
from harness.rl.loop import ClosedLoop, RunPlan, model_overrides, task_of
from harness.rl.memory import check_rl_spec
from harness.rl.ranks import Ranks, check_loop_layout
from harness.rl.spec import RLSpec
from harness.rl.trace import TraceWriter
from harness.rl.warmstart import warm_start_state
from harness.run.columns import git_rev
from harness.run.setup import resolve_device
from harness.safe_fs import UnsafePathError, check_writable
from harness.spec.load import safe_name

__all__ = ["RLRunError", "preflight", "run_claim2", "plans_of", "folder_of", "collected"]

Log = Callable[[str], None]


class RLRunError(RuntimeError):
    """The spec cannot run here; the message says what is missing."""


def preflight(
    spec: RLSpec, preset: str | None, launched: bool = False, device_here: bool = True
) -> torch.device | None:
    """Refuse, before any work, what this build cannot run; returns the device (None unless
    ``device_here``: the ranks run elsewhere, e.g. a Slurm job). ``launched``: this process is one rank of
    the spec's multi-rank job, or starts them (``harness.rl.ranks``)."""
    par = spec.parallel
    try:
        check_loop_layout(par.model_dump())
        model_overrides(spec, task_of(spec))
    except ValueError as e:
        raise RLRunError(f"preset {preset or '-'}: {e}") from None
    if par.world_size > 1 and not launched:
        raise RLRunError(
            f"preset {preset or '-'} runs on {par.world_size} ranks ({par.label}): start it with `pf-bench rl` "
            "(it launches the ranks), not in this process"
        )
    device = None
    if device_here:
        try:
            device = resolve_device(spec.device)
        except RuntimeError as e:
            hint = " (on a Slurm GPU cluster: --executor slurm)" if par.world_size > 1 else ""
            raise RLRunError(f"device: {e}{hint}") from None
    try:  # on the meta device: the sequences fit the model, the runs' memory floor fits here
        check_rl_spec(spec, len(plans_of(spec)) if spec.schedule == "lockstep" else 1, device)
    except ValueError as e:  # MemoryRefusal included
        raise RLRunError(f"preset {preset or '-'}: {e}") from None
    return device


def folder_of(out: str | Path, spec: RLSpec, preset: str | None) -> Path:
    return Path(out) / safe_name(spec.name) / safe_name(preset or "default")


def trace_name(dtype: str, lr: float | None, seed: int) -> str:
    return f"baseline-{dtype}-s{seed}" if lr is None else f"baseline-{dtype}-lr{lr:g}-s{seed}"


def plans_of(spec: RLSpec) -> list[RunPlan]:
    """The compared trainers at ``seed``, every trainer again at ``reference_seed``, and short trace runs."""
    loop, trace = spec.loop, spec.trace
    traces = trace.runs if trace is not None else []
    main = next((r for r in traces if spec.is_main_trace(r)), None)
    plans = []
    for t in spec.trainers:
        exports = main is not None and t == "baseline"
        plans.append(
            RunPlan(
                f"{t}-s{spec.seed}",
                t,
                spec.seed,
                loop.dtype,
                loop.steps,
                "compare",
                trace.steps if exports else 0,
                None,
                trace_name(loop.dtype, None, spec.seed) if exports else None,
            )
        )
    if spec.reference_seed is not None:
        s = spec.reference_seed
        plans += [RunPlan(f"{t}-s{s}", t, s, loop.dtype, loop.steps, "reference") for t in spec.trainers]
    for r in traces:
        if r is not main:
            name = trace_name(r.dtype, r.lr, spec.seed)
            plans.append(
                RunPlan(
                    name.replace("baseline-", "trace-"),
                    "baseline",
                    spec.seed,
                    r.dtype,
                    trace.steps,
                    "trace",
                    trace.steps,
                    r.lr,
                    name,
                )
            )
    return plans


def _base(spec: RLSpec, preset: str | None, device: torch.device) -> dict[str, Any]:
    task = task_of(spec)
    loop = spec.loop
    return {
        "spec": spec.name,
        "preset": preset or "default",
        "identity": spec.identity(),
        "git_rev": git_rev(),
        "host": socket.gethostname(),
        "device": device.type,
        "model": spec.model.display,
        "model_overrides": json.dumps(model_overrides(spec, task), sort_keys=True),
        "prefix_len": task.prompt_len,
        "suffix_len": task.response_len,
        "prefix_ratio": task.prefix_ratio,
        "task_kind": spec.task.kind,
        "n": loop.n,
        "prompts_per_step": loop.prompts_per_step,
        "layout": loop.layout,
        "microbatch": loop.microbatch,
        "compile": False,
        "ac": "none",
        "offload": False,
        **spec.parallel.model_dump(),
        "world_size": spec.parallel.world_size,
        "status": "ok",
    }


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _trace_header(spec: RLSpec, plan: RunPlan) -> dict[str, Any]:
    loop, task = spec.loop, task_of(spec)
    return {
        "model": spec.model.name,
        "overrides": model_overrides(spec, task),
        "dtype": plan.dtype,
        "system": plan.system,
        "seed": spec.seed,
        "run": plan.name,
        "git_rev": git_rev(),
        "loss_config": loop.loss_config(),
        "layout": loop.layout,
        "microbatch": loop.microbatch,
        "attention": loop.attention,
        "optimizer": {
            "type": "AdamW",
            "betas": list(loop.betas),
            "eps": loop.eps,
            "weight_decay": loop.weight_decay,
            "fused": loop.fused_adamw,
            "max_grad_norm": loop.max_grad_norm,
        },
    }


class _Run:
    """One plan's loop, its record rows and files."""

    def __init__(self, spec, task, plan, folder, init, device, base, log, ranks: Ranks) -> None:
        self.spec, self.plan, self.log, self.root, self.ranks = spec, plan, log, folder, ranks
        self.dir = folder / "_state" / "runs" / plan.name
        self.records = folder / "records" / f"{plan.name}.parquet"
        self.identity = spec.identity(run=plan.name, dtype=plan.dtype, steps=plan.steps, lr=plan.lr)
        self.loop = ClosedLoop(spec, task, plan, init, device, ranks)
        self.base = {
            **base,
            "system": plan.system,
            "seed": plan.seed,
            "dtype": plan.dtype,
            "run": plan.name,
            "role": plan.role,
            "record_kind": "rl_step",
        }
        self.rows: list[dict[str, Any]] = []
        self.trace = None
        if plan.trace_steps:
            self.trace_dir = folder / "_state" / "traces" / plan.trace_name
            self.trace = TraceWriter(self.trace_dir, _trace_header(spec, plan), root=folder)
        resume = self.dir / "resume.safetensors"
        if ranks.from_main(resume.exists()):
            self.loop.load_resume(resume, self.identity)
            if self.records.exists():
                old = read_records(self.records)
                self.rows = [r for r in old.to_dict("records") if r["step"] <= self.loop.step_done]
            if len(self.rows) != self.loop.step_done:
                raise TraceError(
                    f"{self.records}: holds {len(self.rows)} rows for {self.loop.step_done} resumed steps"
                )
            log(f"{plan.name}: resumed at step {self.loop.step_done}")
        elif self.trace is not None:
            self.trace.write_initial(self.loop.actor, self.loop.optimizer)

    @property
    def done(self) -> bool:
        return self.loop.step_done >= self.plan.steps

    def release(self) -> None:
        """Free the run's models and optimizer state (its records, trace and step count stay)."""
        loop = self.loop
        loop.actor = loop.rollout = loop.ref = loop.optimizer = loop.init = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def step(self) -> dict[str, Any]:
        record, trace = self.loop.step()
        step = record["step"]
        row = {**self.base, **record, "timestamp": _now()}
        self.rows.append(row)
        traced = self.trace is not None and step <= self.plan.trace_steps
        checkpoint = step % self.spec.checkpoint_every == 0 or step == self.plan.steps
        weights = self.loop.weights() if traced or checkpoint else None  # a gather on many ranks
        if traced:
            self.trace.write_step(step, {**trace, "weights": weights}, record["loss"])
            if step == self.plan.trace_steps:
                self.trace.finish(step)
        if checkpoint:
            save_tensors(
                self.dir / "checkpoints" / f"step_{step:05d}.safetensors",
                weights,
                {"step": str(step), "run": self.plan.name},
                root=self.root,
            )
            self.loop.save_resume(self.dir / "resume.safetensors", self.identity, root=self.root)
        write_rl_records(self.records, self.rows, self.root)
        return row


@contextmanager
def _collect_between_steps() -> Iterator[None]:
    """Python's automatic garbage collection off while the runs step (TorchTitan's ``GarbageCollection``
    does the same): the loop collects between steps instead, outside every timed phase, for every run alike."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def check_out(spec: RLSpec, preset: str | None, out: str | Path) -> Path:
    """The records folder under ``out``, checked writable (no link between them) before any work."""
    folder = folder_of(out, spec, preset)
    try:  # no link between OUT and the records folder; a clear error before any work
        check_writable(folder / "_state", out)
    except (OSError, UnsafePathError) as e:
        raise RLRunError(f"--out: cannot write under {folder}: {getattr(e, 'strerror', None) or e}") from None
    return folder


def _step_round(runs: list[_Run], spec: RLSpec, log: Log) -> None:
    """One step of every unfinished run (Python's collection between steps, untimed)."""
    for run in runs:
        if not run.done:
            row = run.step()
            checkpoint = row["step"] % spec.checkpoint_every == 0 or run.done
            gc.collect(2 if checkpoint else 1)  # untimed, between steps: no pause in a timed phase
            if checkpoint:
                log(
                    f"{run.plan.name}: step {row['step']}/{run.plan.steps} reward "
                    f"{row['reward_mean']:.3f} loss {row['loss']:+.4f} step {row['step_s']:.2f}s "
                    f"(update {row['update_s']:.2f}s)"
                )


def run_claim2(
    spec: RLSpec, preset: str | None, out: str | Path, log: Log = print, device: torch.device | None = None
) -> Path:
    """Everything Claim 2 records, resumably; returns the records folder. In a process group (every rank
    runs this, ``harness.rl.ranks``) the actor is parallelized over ``spec.parallel`` and rank 0 writes."""
    launched = dist.is_available() and dist.is_initialized()
    dev = preflight(spec, preset, launched)
    device = device or dev
    ranks = Ranks.joined(spec.parallel.model_dump(), device) if launched else Ranks.single()
    folder = check_out(spec, preset, out) if ranks.main else folder_of(out, spec, preset)
    ranks.barrier()
    task = task_of(spec)
    base = _base(spec, preset, device)
    write_json(folder / "_state" / "spec.json", spec.model_dump(mode="json"), root=folder)
    init, ws_record = warm_start_state(spec, folder / "_state", device, base, log, ranks)
    write_rl_records(folder / "warmstart.parquet", [ws_record], folder)
    plans = plans_of(spec)
    reference = Claim3Reference(spec, folder, device, base, log, ranks)
    compare_done = spec.loop.steps  # sequential: the reference is measured after the runs
    if spec.schedule == "lockstep":
        runs = [_Run(spec, task, p, folder, init, device, base, log, ranks) for p in plans]
        compare_done = min(r.loop.step_done for r in runs if r.plan.role == "compare")
    reference.resume(compare_done)
    with _collect_between_steps():
        if spec.schedule == "lockstep":
            while not all(r.done for r in runs):
                _step_round(runs, spec, log)
                compare = [r for r in runs if r.plan.role == "compare"]
                reference.after(
                    min(r.loop.step_done for r in compare), [row for r in compare for row in r.rows]
                )
        else:  # one run at a time, its models freed before the next is built (a large model's memory)
            runs = []
            for plan in plans:
                run = _Run(spec, task, plan, folder, init, device, base, log, ranks)
                while not run.done:
                    _step_round([run], spec, log)
                run.release()
                runs.append(run)
            rows = [row for r in runs if r.plan.role == "compare" for row in r.rows]
            for step in range(spec.checkpoint_every, spec.loop.steps, spec.checkpoint_every):
                reference.after(step, rows)
    for run in runs:  # a run resumed past its trace steps may have been killed before writing the manifest
        if run.trace is not None and not (run.trace_dir / "manifest.json").exists():
            run.trace.finish(run.plan.trace_steps)
    ranks.barrier()  # rank 0's checkpoints and traces are on disk for every rank from here
    div = divergence_records(spec, folder, plans, init, base) if ranks.main else []
    if div:
        write_rl_records(folder / "divergence.parquet", div, folder)
    for run in runs:
        if run.trace is None:
            continue
        # an fp32 trace is also replayed by the baseline in fp64: the source's own rounding, the floor for
        # the other fp32 replays (Adam's sign-like first steps amplify rounding-level gradient differences)
        floor = [("baseline", True)] if run.plan.dtype == "fp32" else []
        for system, fp64 in [(s, False) for s in spec.trace.systems] + floor:
            tag = f"{system}-fp64" if fp64 else system
            path = folder / f"replay-{run.trace_dir.name}-{tag}.parquet"
            if ranks.from_main(path.exists() and read_records(path)["identity"].eq(base["identity"]).all()):
                continue
            rows = replay_records(run.trace_dir, system, device, base, log, fp64=fp64, ranks=ranks)
            rows = [{**r, "preset": base["preset"], "identity": base["identity"]} for r in rows]
            write_rl_records(path, rows, folder)
    reference.after(spec.loop.steps, [row for r in runs if r.plan.role == "compare" for row in r.rows])
    return folder


def collected(folder: Path) -> pd.DataFrame:
    """Every record under ``folder`` (for the summary printed after a run)."""
    from harness.records import collect

    return collect(folder)
