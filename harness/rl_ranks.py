"""The Claim-2 loop on many ranks: what its processes share, and how they are started.

One process (``Ranks.single()``) or every rank of a ``torch.distributed`` job (``Ranks.joined(spec)``) runs the
same :func:`harness.rl_run.run_claim2`. On many ranks:

- **models**: each actor (and the frozen reference) is parallelized over the spec's layout in TorchTitan's
  order (``prefixflow.parallel.parallelize``, one device mesh for all of them); the rollout model is a full
  replica on every rank, as a colocated inference engine holds its own copy, filled by ``sync_weights``;
- **generation**: prompt ``i`` of a step is sampled on rank ``i mod world`` (its noise is seeded by the
  prompt, so the rollouts are the ones one process samples) and every rank receives all of them;
- **times**: each phase's time is the slowest rank's (the ranks meet at the phase's collectives);
- **files**: rank 0 alone writes (``harness.rl_io``); every rank calls the gathers that precede a write.

Starting the ranks: :func:`run_local` (this machine, loopback only, ``harness.execute.local_ranks``) and
:func:`submit_slurm` (one multi-task Slurm job through submitit, one task per rank). Each rank runs
``python -m harness.rl_ranks JOB.json``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Ranks", "LOOP_DIMS", "check_loop_layout", "run_on_ranks", "run_local", "submit_slurm", "main"]

# The mesh dimensions the loop's actor runs on (the trainer pieces are tested on them: tests/test_rl_parallel.py).
LOOP_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")


def check_loop_layout(parallel: dict[str, int]) -> None:
    """Raise ``ValueError`` naming the field if the layout uses a dimension the closed loop does not run."""
    other = [f"{k}={v}" for k, v in parallel.items() if v > 1 and k not in LOOP_DIMS]
    if other:
        raise ValueError(
            f"parallel: the closed loop's actor runs on {', '.join(LOOP_DIMS)}; {', '.join(other)} is not "
            f"supported in the loop (set those degrees to 1)"
        )


@dataclass
class Ranks:
    """This process's place among the loop's processes, and what they do together."""

    rank: int = 0
    world: int = 1
    dims: dict[str, int] | None = None
    mesh: Any = None

    @classmethod
    def single(cls) -> Ranks:
        return cls()

    @classmethod
    def joined(cls, parallel: dict[str, int], device: torch.device) -> Ranks:
        """Every rank of the running process group, laid out as ``parallel`` (the spec's degrees)."""
        from prefixflow.parallel import ParallelDims, build_mesh

        dims = ParallelDims.of(parallel)
        if dist.get_world_size() != dims.world_size:
            raise ValueError(
                f"parallel layout {dims.label} needs {dims.world_size} ranks; this job has {dist.get_world_size()}"
            )
        return cls(dist.get_rank(), dims.world_size, dims.as_dict(), build_mesh(dims, device))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def parallelize(self, model: nn.Module) -> nn.Module:
        """``model`` parallelized over the loop's layout (on one process: unchanged)."""
        if self.world == 1:
            return model
        from prefixflow.parallel import parallelize

        return parallelize(model, self.dims, mesh=self.mesh)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def from_main(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (small, picklable objects: records, numbers)."""
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def share(self, make: Callable[[int], Any], count: int) -> list[Any]:
        """``[make(0), ..., make(count - 1)]`` on every rank, item ``i`` computed on rank ``i mod world``.
        Tensors in the items travel on the CPU and come back on their device."""
        if self.world == 1:
            return [make(i) for i in range(count)]
        mine = {i: _to(make(i), "cpu") for i in range(self.rank, count, self.world)}
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, mine)
        merged = {i: item for part in parts for i, item in part.items()}
        device = self.mesh.device_type
        return [_to(merged[i], device) for i in range(count)]

    def slowest(self, times: dict[str, float]) -> dict[str, float]:
        """Each time the maximum over ranks (NaN only where every rank has NaN)."""
        from harness.run.measure import rank_max

        return rank_max(times) if self.world > 1 else dict(times)


def _to(obj: Any, device: str | torch.device) -> Any:
    """``obj`` with every tensor (in lists, tuples, dicts and dataclasses) moved to ``device``."""
    import dataclasses

    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, list | tuple):
        return type(obj)(_to(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: _to(getattr(obj, f.name), device) for f in dataclasses.fields(obj)}
        )
    return obj


# ---- starting the ranks ---------------------------------------------------------------------------------


def write_job(path: Path, spec_json: dict[str, Any], preset: str | None, out: Path) -> Path:
    """The ranks' job file (JSON, in the private jobs folder): the resolved spec, its preset, ``--out``."""
    from harness.rl_io import write_json

    return write_json(path, {"spec": spec_json, "preset": preset, "out": str(Path(out).absolute())})


def run_local(job: Path, world: int, timeout_s: float) -> int:
    """Run the loop on ``world`` ranks of this machine (loopback only); the launcher's exit status. The ranks
    print to this process's stdout and stderr."""
    from harness.execute.local import rank_threads, run_local_ranks

    try:
        proc = run_local_ranks(
            world,
            "harness.rl_ranks",
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
    from harness.rl_run import RLRunError, check_out, preflight
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
    from harness.rl_io import TraceError, read_json
    from harness.rl_run import RLRunError, run_claim2
    from harness.rl_spec import RLSpec
    from prefixflow.parallel import init_distributed

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m harness.rl_ranks JOB.json", file=sys.stderr)
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
