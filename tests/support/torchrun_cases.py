"""Multi-rank test support: one launch of local ranks per test module, every case inside it.

A test module calls :func:`launch_cases` once (module-scoped fixture); its ``__main__`` block runs on every
rank, calls :func:`run_worker` with its case list, and rank 0 writes one JSON of results. A launch costs
~20 s (importing torchtitan), so cases share it. The ranks start under ``harness.execute.local_ranks``: the store
listens on 127.0.0.1 only, and gloo is pinned to the loopback interface.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def launch_worker(
    target: str, nproc: int, argv: list[str], out: Path, *, timeout: float = 900, module: bool = True
) -> dict:
    """Run ``target`` (a module under tests/, or a script with ``module=False``) on ``nproc`` local ranks
    (``harness.execute.local_ranks``: loopback only) with ``argv``; return the JSON rank 0 wrote to ``out``
    (raises with the ranks' output when the launch fails). Every multi-rank test module launches through it."""
    from harness.execute.local import run_local_ranks

    proc = run_local_ranks(
        nproc, target, argv, timeout_s=timeout, module=module, cwd=REPO, extra_path=[REPO / "tests"]
    )
    return _rank0_json(proc, out, "ranks")


def launch_cases(script: Path, nproc: int, out: Path, *args: str, timeout: float = 900) -> dict:
    """Run ``script`` on ``nproc`` local ranks (:func:`launch_worker`); return rank 0's JSON."""
    return launch_worker(str(script), nproc, [str(out), *args], out, timeout=timeout, module=False)


def _rank0_json(proc, out: Path, what: str) -> dict:
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(
            f"{what} failed ({proc.returncode}):\n{(proc.stdout or b'').decode(errors='replace')[-4000:]}\n"
            f"{(proc.stderr or b'').decode(errors='replace')[-8000:]}"
        )
    return json.loads(out.read_text())


def launch_torchrun(script: Path, nproc: int, out: Path, *args: str, timeout: float = 900) -> dict:
    """:func:`launch_cases` through ``torchrun`` instead: the c10d rendezvous on a free 127.0.0.1 port, gloo pinned
    to the loopback interface, one thread per rank."""
    import os
    import socket
    import subprocess

    from harness.execute.local import local_env

    with socket.socket() as s:  # a free loopback port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = local_env(threads=1)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), env["PYTHONPATH"]])
    argv = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--local-addr=127.0.0.1",
        str(script), str(out), *args,
    ]  # fmt: skip
    proc = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, timeout=timeout, check=False)
    return _rank0_json(proc, out, "torchrun ranks")


def max_rel(got, want) -> float:
    """Max over tensors of max|got - want| / max|want|; NaN or inf anywhere gives inf (``max()`` would drop it)."""
    import math

    worst = 0.0
    for g, w in zip(got, want, strict=True):
        if g is None:
            return math.inf
        d = float((g - w).abs().max()) / (float(w.abs().max()) or 1.0)
        if not math.isfinite(d):
            return math.inf
        worst = max(worst, d)
    return worst


def run_worker(cases: dict[str, Callable[[], dict]], out: str, select: list[str] | None = None) -> None:
    """On every rank: run each case (a callable returning JSON-able numbers, identical on every rank for the
    keys that matter); rank 0 writes ``{name: result}``. A case that raises records its traceback."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    results = {}
    for name, case in cases.items():
        if select and name not in select:
            continue
        print(f"[rank {rank}] case {name}", file=sys.stderr, flush=True)
        try:
            results[name] = case()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            print(f"[rank {rank}] case {name} failed:\n{results[name]['error']}", file=sys.stderr, flush=True)
    dist.barrier()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
