"""Executors: ``debug`` (in-process), ``local`` (worker subprocesses, bounded), ``slurm`` (submitit arrays), and
``estimate`` (local worker subprocesses that estimate each cell on fake tensors: ``harness.estimate``).

Every executor takes cells and a spec folder and guarantees one record file per cell: the worker writes it,
and where a worker cannot (timeout, hard crash, lost job) the executor writes status timeout/error rows.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness.execute.jobs import write_job
from harness.execute.local import local_ranks_argv
from harness.execute.local_ranks import loopback_env
from harness.execute.outcome import (  # noqa: F401 (check_record, recorded_status: this module's API too)
    OnDone,
    check_record,
    job_path,
    record_path,
    recorded_status,
)
from harness.execute.outcome import finish as _finish
from harness.execute.outcome import tail as _tail
from harness.execute.slurm_executor import CellJob, SlurmExecutor  # noqa: F401 (re-exported)
from harness.execute.worker import run_job
from harness.run.columns import REPO_ROOT
from harness.safe_fs import open_new
from harness.spec.cell import Cell
from harness.spec.schema import ExecutorSettings

EXECUTORS = ("local", "slurm", "debug", "estimate")
WORKER_ARGV = [sys.executable, "-m", "harness.execute.worker"]


class DebugExecutor:
    """In-process, one cell after another (no timeouts: a hung cell hangs the sweep)."""

    name = "debug"

    def __init__(self, estimate: bool = False) -> None:
        self.estimate = estimate  # each cell estimated on fake tensors (harness.estimate), not run

    def run(self, cells: list[Cell], folder: Path, on_done: OnDone) -> None:
        runner = None
        if self.estimate:
            from harness.estimate.worker import estimate_here as runner
        for cell in cells:
            on_done(cell, run_job(cell, record_path(folder, cell), runner))


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the sweep process dies (Linux PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class LocalExecutor:
    """Worker subprocesses (``python -m harness.execute.worker JOB.json``), at most ``max_jobs`` at once, each in its
    own process group, killed on timeout and when the sweep process dies."""

    name = "local"
    worker = "harness.execute.worker"  # the module each cell's process runs

    def __init__(self, max_jobs: int = 2, timeout_min: float | None = None, poll_s: float = 0.1) -> None:
        self.max_jobs = max(1, max_jobs)
        self.timeout_min = timeout_min
        self.poll_s = poll_s
        self.threads = max(1, (os.cpu_count() or 1) // self.max_jobs)

    def _slots(self, cell: Cell) -> int:
        """Job slots a cell takes: one per rank (a cell wider than ``max_jobs`` runs alone)."""
        return min(cell.world_size, self.max_jobs)

    def _env(self, cell: Cell) -> dict[str, str]:
        env = dict(os.environ)
        threads = max(1, self.threads * self._slots(cell) // cell.world_size)  # per rank
        env.setdefault("OMP_NUM_THREADS", str(threads))
        env.setdefault("PF_BENCH_THREADS", str(threads))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        if cell.world_size > 1:
            env = loopback_env(env)  # ranks talk over loopback only
        return env

    def _argv(self) -> list[str]:
        return WORKER_ARGV

    def _start(self, cell: Cell, folder: Path) -> tuple[subprocess.Popen, float]:
        jpath = write_job(job_path(folder, cell), cell, record_path(folder, cell))
        logs, root = folder / "_logs", folder.parent
        argv = [*self._argv(), str(jpath)]
        if (
            cell.world_size > 1 and self._slots(cell) > 1
        ):  # one worker per local rank; rank 0 writes the record
            argv = local_ranks_argv(cell.world_size, self.worker, [str(jpath)])
        with (
            open_new(logs / f"{cell.cell_id}.out", root) as out,
            open_new(logs / f"{cell.cell_id}.err", root) as err,
        ):
            proc = subprocess.Popen(
                argv,
                cwd=REPO_ROOT,
                env=self._env(cell),
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        return proc, time.monotonic()

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker's own group (start_new_session)
        except ProcessLookupError:
            pass
        proc.wait()

    def run(self, cells: list[Cell], folder: Path, on_done: OnDone) -> None:
        pending = list(cells)
        running: dict[str, tuple[Cell, subprocess.Popen, float]] = {}
        limit = None if self.timeout_min is None else self.timeout_min * 60
        try:
            while pending or running:
                while (
                    pending
                    and sum(self._slots(c) for c, _, _ in running.values()) + self._slots(pending[0])
                    <= self.max_jobs
                ):
                    cell = pending.pop(0)
                    proc, started = self._start(cell, folder)
                    running[cell.cell_id] = (cell, proc, started)
                for cid, (cell, proc, started) in list(running.items()):
                    lim = cell.timeout_min * 60 if limit is None else limit
                    rc = proc.poll()
                    if rc is None and time.monotonic() - started <= lim:
                        continue
                    rpath = record_path(folder, cell)
                    if rc is None:
                        self._kill(proc)
                        msg = f"cell exceeded its timeout of {lim:.1f} s and was killed"
                        status = _finish(cell, rpath, "timeout", msg)
                    elif rc != 0:
                        err = _tail(folder / "_logs" / f"{cid}.err")
                        status = _finish(cell, rpath, "error", f"worker exited with code {rc}\n{err}")
                    else:
                        status = _finish(cell, rpath, "error", "worker exited 0 without writing a record")
                    del running[cid]
                    on_done(cell, status)
                time.sleep(self.poll_s)
        finally:
            for _, proc, _ in running.values():
                self._kill(proc)


class EstimateExecutor(LocalExecutor):
    """:class:`LocalExecutor` whose workers estimate their cell on fake tensors (``harness.estimate.worker``):
    one process per cell whatever its layout (an estimate runs in one process)."""

    name = "estimate"
    worker = "harness.estimate.worker"
    estimate = True

    def _slots(self, cell: Cell) -> int:
        return 1

    def _argv(self) -> list[str]:
        return [sys.executable, "-m", self.worker]


def make_executor(kind: str, settings: ExecutorSettings, max_jobs: int | None = None):
    """The executor named ``kind`` (one of EXECUTORS)."""
    if kind == "debug":
        return DebugExecutor()
    if kind == "estimate":
        return EstimateExecutor(max_jobs=max_jobs or settings.max_jobs)
    if kind == "local":
        return LocalExecutor(max_jobs=max_jobs or settings.max_jobs)
    if kind == "slurm":
        return SlurmExecutor(settings, max_jobs=max_jobs)
    raise ValueError(f"unknown executor {kind!r}; allowed: {', '.join(EXECUTORS)}")
