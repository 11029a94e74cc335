"""Many ranks: local ranks on this machine, and the environment of one Slurm task per rank.

- :func:`local_ranks_argv` / :func:`run_local_ranks`: start ``nproc`` ranks of a Python module (or script) on
  this machine under ``harness.execute.local_ranks``, which listens on loopback only (its store on a socket bound to
  127.0.0.1, gloo and NCCL on ``lo``; ``torchrun`` would listen on every interface). A free port per launch,
  so launches never collide.
- :func:`run_cell`: a cell here when this process is one of its ranks (or it has one), else on local ranks
  (:func:`run_cell_local_ranks`: every rank runs ``harness.execute.worker``, rank 0 writes the record;
  ``harness.run.parallel_step`` merges the ranks: rank-max times, per-rank values and their spread).
- :func:`run_alignment_ranks`: ``pf-bench align`` on local ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.execute.local_ranks import loopback_env

__all__ = [
    "local_ranks_argv",
    "run_local_ranks",
    "local_env",
    "rank_threads",
    "run_cell",
    "run_cell_local_ranks",
    "run_alignment_ranks",
]


def local_ranks_argv(nproc: int, target: str, args: Sequence[str] = (), module: bool = True) -> list[str]:
    """``python -m harness.execute.local_ranks`` starting ``nproc`` ranks of ``python -m target args`` (of the
    script ``target`` when ``module`` is false), every socket on loopback."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    return [
        sys.executable,
        "-m",
        "harness.execute.local_ranks",
        f"--nproc-per-node={nproc}",
        *(["-m"] if module else []),
        target,
        *args,
    ]


def local_env(threads: int | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for local ranks: loopback-only gloo and NCCL, ``threads`` per rank, the repository on
    the path."""
    env = loopback_env(dict(os.environ if base is None else base))
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
        env["PF_BENCH_THREADS"] = str(threads)
    repo = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH", "")) if p)
    return env


def run_local_ranks(
    nproc: int,
    target: str,
    args: Sequence[str] = (),
    *,
    timeout_s: float,
    module: bool = True,
    threads: int | None = 1,
    cwd: str | Path | None = None,
    extra_path: Sequence[str | Path] = (),
    stdout=None,
    stderr=None,
) -> subprocess.CompletedProcess:
    """Run ``nproc`` local ranks of ``target`` to completion (killed after ``timeout_s``, the ranks with
    the launcher); ``extra_path`` goes first on the ranks' ``PYTHONPATH``."""
    env = local_env(threads)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, extra_path), env["PYTHONPATH"]])
    return subprocess.run(
        local_ranks_argv(nproc, target, args, module),
        env=env,
        cwd=cwd,
        stdout=stdout if stdout is not None else subprocess.PIPE,
        stderr=stderr if stderr is not None else subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        timeout=timeout_s,
        check=False,
    )


def rank_threads(world_size: int) -> int:
    """Threads per rank: ``PF_BENCH_THREADS`` if set, else the CPUs shared out over the ranks."""
    value = os.environ.get("PF_BENCH_THREADS", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    return max(1, (os.cpu_count() or 1) // world_size)


def run_cell_local_ranks(cell, timeout_s: float | None = None) -> list[dict[str, Any]]:
    """Run a multi-rank ``cell`` on local ranks and return its merged records (a failure record
    with the ranks' stderr when they wrote none)."""
    import tempfile

    from harness.execute.jobs import write_job
    from harness.records import read_records
    from harness.run.columns import failed_records

    with tempfile.TemporaryDirectory(prefix="pf-ranks-") as tmp:
        record = Path(tmp) / f"{cell.cell_id}.parquet"
        job = write_job(Path(tmp) / "job.json", cell, record)
        limit = timeout_s if timeout_s is not None else cell.timeout_min * 60
        try:
            proc = run_local_ranks(
                cell.world_size,
                "harness.execute.worker",
                [str(job)],
                timeout_s=limit,
                threads=rank_threads(cell.world_size),
            )
        except subprocess.TimeoutExpired:
            return failed_records(cell, "timeout", f"{cell.world_size} ranks exceeded {limit:.0f} s")
        if not record.exists():
            tail = proc.stderr.decode(errors="replace")[-4000:]
            return failed_records(cell, "error", f"ranks exited {proc.returncode} without a record\n{tail}")
        return read_records(record).to_dict("records")


def run_cell(cell, folder: str | Path | None = None) -> list[dict[str, Any]] | None:
    """``cell``'s records (``harness.run.cell.run_cell``) in this process when it is one of the cell's ranks
    or the cell has one rank; else from its local ranks, after the checks that need no rank (device,
    layout) so a cell that cannot run starts none. None on a rank other than 0."""
    from harness.run.cell import run_cell as run_here
    from harness.run.frontier import refuse_ranks
    from harness.run.measurement import refusal

    if cell.world_size > 1 and os.environ.get("WORLD_SIZE") != str(cell.world_size):
        measured = cell.frontier is None and cell.alignment is None
        refused = refusal(cell) if measured else refuse_ranks(cell)
        return refused if refused is not None else run_cell_local_ranks(cell)
    return run_here(cell, folder)


def run_alignment_ranks(parallel, kwargs: dict[str, Any], timeout_s: float = 3600) -> list[dict[str, Any]]:
    """``prefixflow.parallel.align.run_parallel_alignment(**kwargs)`` on ``parallel.world_size`` local ranks;
    the rows (as dicts). Raises ``ValueError`` with the ranks' message when they fail."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory(prefix="pf-align-") as tmp:
        job, out = Path(tmp) / "align.json", Path(tmp) / "rows.json"
        job.write_text(json.dumps({"dims": parallel.model_dump(), **kwargs}))
        try:
            proc = run_local_ranks(
                parallel.world_size,
                "harness.execute.local",
                ["align", str(job), str(out)],
                timeout_s=timeout_s,
                threads=rank_threads(parallel.world_size),
            )
        except subprocess.TimeoutExpired:
            raise ValueError(f"alignment on {parallel.world_size} ranks exceeded {timeout_s:.0f} s") from None
        result = json.loads(out.read_text()) if out.exists() else None
        if result is None or "error" in result:
            detail = result["error"] if result else proc.stderr.decode(errors="replace")[-4000:]
            raise ValueError(f"alignment on {parallel.world_size} ranks failed: {detail}")
        return result["rows"]


def _align_main(job_path: str, out_path: str) -> int:
    """One rank of :func:`run_alignment_ranks`; rank 0 writes ``{"rows": [...]}`` or ``{"error": ...}``."""
    import json
    import traceback

    import torch
    import torch.distributed as dist

    from prefixflow.model.dtypes import DTYPES
    from prefixflow.parallel import init_distributed
    from prefixflow.parallel.align import run_parallel_alignment

    spec = json.loads(Path(job_path).read_text())
    spec["dtype"] = DTYPES[spec["dtype"]]
    threads = os.environ.get("PF_BENCH_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    init_distributed("cuda" if torch.cuda.is_available() else "cpu")
    try:
        result = {"rows": [r.as_dict() for r in run_parallel_alignment(**spec)]}
    except (ValueError, TypeError) as e:
        result = {"error": str(e)}
    except Exception:
        result = {"error": traceback.format_exc()}
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(result, default=float))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "align":
        print("usage: python -m harness.execute.local align JOB.json OUT.json", file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(_align_main(sys.argv[2], sys.argv[3]))
