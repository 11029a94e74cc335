"""Many ranks: ``torchrun`` on this machine, and the environment of one Slurm task per rank.

- :func:`torchrun_argv` / :func:`run_torchrun`: start ``nproc`` ranks of a Python module on this machine
  (``python -m torch.distributed.run --standalone``: a free local port per launch, so launches never
  collide; gloo's traffic stays on the loopback interface).
- :func:`run_cell_torchrun`: a multi-rank cell from a single process (``pf-bench run``, the debug executor):
  torchrun runs ``harness.worker`` on every rank, rank 0 writes the record (``harness.rank_runner`` merges
  the ranks: rank-max times, per-rank values and their spread).
- :func:`export_slurm_rank_env`: inside a Slurm task (one task per rank, submitit), the environment
  ``torch.distributed`` reads.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "torchrun_argv",
    "run_torchrun",
    "local_env",
    "export_slurm_rank_env",
    "rank_threads",
    "run_cell_torchrun",
]


def torchrun_argv(nproc: int, module: str, args: Sequence[str] = ()) -> list[str]:
    """``python -m torch.distributed.run`` starting ``nproc`` ranks of ``python -m module args``."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        module,
        *args,
    ]


def local_env(threads: int | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for local ranks: loopback-only gloo, ``threads`` per rank, the repository on the path."""
    env = dict(os.environ if base is None else base)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
        env["PF_BENCH_THREADS"] = str(threads)
    repo = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH", "")) if p)
    return env


def run_torchrun(
    nproc: int,
    module: str,
    args: Sequence[str] = (),
    *,
    timeout_s: float,
    threads: int | None = 1,
    cwd: str | Path | None = None,
    extra_path: Sequence[str | Path] = (),
    stdout=None,
    stderr=None,
) -> subprocess.CompletedProcess:
    """Run ``nproc`` local ranks of ``module`` to completion (killed after ``timeout_s``); ``extra_path``
    goes first on the ranks' ``PYTHONPATH``."""
    env = local_env(threads)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, extra_path), env["PYTHONPATH"]])
    return subprocess.run(
        torchrun_argv(nproc, module, args),
        env=env,
        cwd=cwd,
        stdout=stdout if stdout is not None else subprocess.PIPE,
        stderr=stderr if stderr is not None else subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        timeout=timeout_s,
        check=False,
    )


def export_slurm_rank_env() -> None:
    """Inside one task of a Slurm multi-task job (one task per rank, submitit): set ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` for ``torch.distributed``. A one-node
    job keeps its traffic on the loopback interface."""
    import submitit

    submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    if submitit.JobEnvironment().num_nodes == 1:
        os.environ["MASTER_ADDR"] = _loopback_address()
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _loopback_address() -> str:
    """``::1`` where IPv6 loopback works, else ``127.0.0.1``. Rank 0's TCPStore listens on the IPv6 wildcard;
    on a node that fences every bind to loopback (the local test Slurm) only ``::1`` of it remains."""
    import socket

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        return "::1"
    except OSError:
        return "127.0.0.1"


def rank_threads(world_size: int) -> int:
    """Threads per rank: ``PF_BENCH_THREADS`` if set, else the CPUs shared out over the ranks."""
    value = os.environ.get("PF_BENCH_THREADS", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    return max(1, (os.cpu_count() or 1) // world_size)


def run_cell_torchrun(cell, timeout_s: float | None = None) -> list[dict[str, Any]]:
    """Run a multi-rank ``cell`` under a local torchrun and return its merged records (a failure record
    with the ranks' stderr when they wrote none)."""
    import tempfile

    from harness.records import read_records
    from harness.runner import failed_records
    from harness.worker import write_job

    with tempfile.TemporaryDirectory(prefix="pf-ranks-") as tmp:
        record = Path(tmp) / f"{cell.cell_id}.parquet"
        job = write_job(Path(tmp) / "job.json", cell, record)
        limit = timeout_s if timeout_s is not None else cell.timeout_min * 60
        try:
            proc = run_torchrun(
                cell.world_size,
                "harness.worker",
                [str(job)],
                timeout_s=limit,
                threads=rank_threads(cell.world_size),
            )
        except subprocess.TimeoutExpired:
            return failed_records(cell, "timeout", f"{cell.world_size} ranks exceeded {limit:.0f} s")
        if not record.exists():
            tail = proc.stderr.decode(errors="replace")[-4000:]
            return failed_records(
                cell, "error", f"torchrun exited {proc.returncode} without a record\n{tail}"
            )
        return read_records(record).to_dict("records")
