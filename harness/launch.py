"""Many ranks: ``torchrun`` on this machine, one multi-task job per cell on Slurm, and rank-max merging.

- :func:`torchrun_argv` / :func:`run_torchrun`: start ``nproc`` ranks of a Python module on this machine
  (``python -m torch.distributed.run --standalone``: a free local port per launch, so launches never
  collide; gloo's traffic stays on the loopback interface).
- :func:`slurm_rank_env`: inside a Slurm task (one task per rank, submitit), the environment variables
  ``torch.distributed`` reads (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).
- :func:`merge_rank_records`: one record per system from every rank's own measurements: timing and memory
  are the rank-max, the per-rank values are kept (``*_per_rank``, JSON) with their spread
  (``(max - min) / max``).
"""

from __future__ import annotations

import json
import math
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
    "slurm_rank_env",
    "merge_rank_records",
    "RANK_MAX_COLUMNS",
]

# Columns whose record value is the max over ranks (the paper's rank-max); their per-rank values are kept.
RANK_MAX_COLUMNS = (
    "step_time_s",
    "step_time_min_s",
    "step_time_max_s",
    "phase_a_s",
    "phase_b_s",
    "phase_c_s",
    "peak_mem_bytes",
    "peak_mem_phase_b_bytes",
    "first_step_s",
)


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


def slurm_rank_env() -> dict[str, str]:
    """``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` of this Slurm task (submitit's
    view of the job: one task per rank), to be merged into ``os.environ`` before joining the group."""
    import submitit

    env = submitit.JobEnvironment()
    nodes = env.hostnames
    port = 20000 + int(env.job_id.split("_")[0]) % 20000
    return {
        "RANK": str(env.global_rank),
        "WORLD_SIZE": str(env.num_tasks),
        "LOCAL_RANK": str(env.local_rank),
        "LOCAL_WORLD_SIZE": str(env.num_tasks // max(1, env.num_nodes)),
        "MASTER_ADDR": nodes[0],
        "MASTER_PORT": str(port),
    }


def _spread(values: list[float]) -> float:
    finite = [v for v in values if v is not None and not math.isnan(v)]
    if not finite or max(finite) == 0:
        return math.nan
    return (max(finite) - min(finite)) / max(finite)


def merge_rank_records(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rank 0's records, with every :data:`RANK_MAX_COLUMNS` value replaced by its max over ranks and the
    per-rank values kept (``<column>_per_rank`` as JSON, ``<column>_spread``). A system that failed on
    any rank is failed (that rank's status and error)."""
    merged = []
    for i, rec in enumerate(per_rank[0]):
        out = dict(rec)
        rows = [ranks[i] for ranks in per_rank]
        bad = next((r for r in rows if r.get("status") != "ok"), None)
        if bad is not None and rec.get("status") == "ok":
            out["status"], out["error"] = bad["status"], bad.get("error")
        for col in RANK_MAX_COLUMNS:
            if col not in rec:
                continue
            values = [r.get(col) for r in rows]
            nums = [float(v) if isinstance(v, int | float) and v is not None else math.nan for v in values]
            finite = [v for v in nums if not math.isnan(v)]
            out[col] = max(finite) if finite else math.nan
            out[f"{col}_per_rank"] = json.dumps([None if math.isnan(v) else v for v in nums])
            out[f"{col}_spread"] = _spread(nums)
        merged.append(out)
    return merged
