"""Starting the Claim-2 loop's ranks: :func:`run_local` (this machine, loopback only,
``harness.execute.local_ranks``) and :func:`submit_slurm` (one multi-task Slurm job through submitit, one task
per rank). Each rank runs ``python -m harness.rl.launch JOB.json`` (:func:`main`), the same
:func:`harness.rl.run.run_claim2` one process runs (``harness.rl.ranks``: what the ranks share).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["run_on_ranks", "run_local", "submit_slurm", "main"]


def write_job(path: Path, spec_json: dict[str, Any], preset: str | None, out: Path) -> Path:
    """The ranks' job file (JSON, in the private jobs folder): the resolved spec, its preset, ``--out``."""
    from harness.rl.io import write_json

    return write_json(path, {"spec": spec_json, "preset": preset, "out": str(Path(out).absolute())})


def run_local(job: Path, world: int, timeout_s: float) -> int:
    """Run the loop on ``world`` ranks of this machine (loopback only); the launcher's exit status. The ranks
    print to this process's stdout and stderr."""
    from harness.execute.local import rank_threads, run_local_ranks

    try:
        proc = run_local_ranks(
            world,
            "harness.rl.launch",
            [str(job)],
            timeout_s=timeout_s,
            threads=rank_threads(world),
            stdout=sys.stdout,
            stderr=sys.stderr,
        )
    except subprocess.TimeoutExpired:
        print(f"the {world} ranks exceeded {timeout_s:.0f} s and were stopped", file=sys.stderr)
        return 124
    return proc.returncode


class _RankJob:
    """The Slurm task body: one rank of the loop (submitit pickles this object into the private jobs folder)."""

    def __call__(self, job: str) -> int:
        from harness.execute.slurm import export_slurm_rank_env

        export_slurm_rank_env()
        return main([job])


def submit_slurm(job: Path, world: int, settings, folder: Path, name: str, log: Callable[[str], None]) -> int:
    """Run the loop as one Slurm job of ``world`` tasks (``settings``: the spec's ``executor``; submitit's
    files in the private jobs folder of the records ``folder``); waits for it (at most its time limit plus
    10 minutes) and returns 0 when every task succeeded."""
    from harness.execute.executors import SlurmExecutor

    ex = SlurmExecutor(settings)._executor(folder, name, world)
    handle = ex.submit(_RankJob(), str(job))
    log(f"submitted Slurm job {handle.job_id} ({world} tasks); logs: {handle.paths.stdout.parent}")
    deadline = time.monotonic() + max(1, math.ceil(settings.timeout_min)) * 60 + 600
    while not handle.done():
        if time.monotonic() > deadline:
            handle.cancel(check=False)
            log(f"Slurm job {handle.job_id} still running past its time limit; cancelled")
            return 124
        time.sleep(5)
    try:
        codes = handle.results()
    except Exception as e:  # submitit raises the failing task's error with its log tail
        log(f"Slurm job {handle.job_id} failed ({handle.state}): {str(e)[-2000:]}")
        return 1
    code = max((int(c) for c in codes), default=0)
    if code:
        tail = (handle.stderr() or "").strip().splitlines()[-5:]
        log(f"Slurm job {handle.job_id}: a task exited {code}; its stderr ends:\n" + "\n".join(tail))
    return code


def run_on_ranks(
    spec, preset: str | None, out: str | Path, executor: str, log: Callable[[str], None]
) -> Path:
    """Run the spec's multi-rank loop to the end on local ranks (``executor="local"``) or as one Slurm job
    (``"slurm"``); returns the records folder. Raises ``RLRunError`` before any work for a layout, device or
    ``--out`` this cannot run, and after the ranks when one of them failed."""
    from harness.rl.run import RLRunError, check_out, preflight
    from harness.safe_fs import jobs_folder

    world = spec.parallel.world_size
    preflight(spec, preset, launched=True, device_here=executor == "local")
    folder = check_out(spec, preset, out)
    jobs = jobs_folder(folder)
    job = write_job(jobs / "rl-job.json", spec.model_dump(mode="json"), preset, Path(out))
    log(f"{spec.name}/{preset or 'default'}: {world} ranks ({spec.parallel.label}) on {executor}")
    if executor == "local":
        code = run_local(job, world, timeout_s=spec.executor.timeout_min * 60)
    elif executor == "slurm":
        code = submit_slurm(job, world, spec.executor, folder, f"pf-{spec.name}", log)
    else:
        raise RLRunError(f"--executor {executor!r}: use local or slurm")
    if code != 0:
        where = "above" if executor == "local" else f"in the job's logs under {jobs / 'slurm'}"
        raise RLRunError(f"the loop's {world} ranks failed (exit status {code}); their messages are {where}")
    return folder


def main(argv: list[str] | None = None) -> int:
    """One rank: join the process group, run the loop, leave. Exit 2 with a one-line message on a user error."""
    from harness.execute.local import rank_threads
    from harness.rl.io import TraceError, read_json
    from harness.rl.run import RLRunError, run_claim2
    from harness.rl.spec import RLSpec
    from prefixflow.parallel import init_distributed

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m harness.rl.launch JOB.json", file=sys.stderr)
        return 2
    data = read_json(argv[0])
    spec = RLSpec.model_validate(data["spec"])
    torch.set_num_threads(rank_threads(spec.parallel.world_size))
    from harness.run.setup import resolve_device

    device = init_distributed(resolve_device(spec.device))
    rank = dist.get_rank()
    try:
        run_claim2(spec, data["preset"], data["out"], log=print if rank == 0 else _quiet, device=device)
    except (RLRunError, TraceError, ValueError) as e:
        print(f"rank {rank}: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _quiet(msg: str) -> None:
    pass


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
