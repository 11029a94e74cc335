"""Executors: ``debug`` (in-process), ``local`` (worker subprocesses, bounded), ``slurm`` (submitit arrays).

Every executor takes cells and a spec folder and guarantees one record file per cell: the worker writes it,
and where a worker cannot (timeout, hard crash, lost job) the executor writes status timeout/error rows.
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import submitit

from harness.execute.jobs import read_job, write_job
from harness.execute.local import local_ranks_argv
from harness.execute.local_ranks import loopback_env
from harness.execute.slurm import export_slurm_rank_env
from harness.execute.worker import run_job
from harness.records import InvalidRecord, cell_status, read_records, write_records
from harness.run.columns import REPO_ROOT, failed_records
from harness.safe_fs import jobs_folder, open_new, trusted_dir
from harness.spec.cell import Cell
from harness.spec.schema import ExecutorSettings

EXECUTORS = ("local", "slurm", "debug")
SLURM_SHIM_DIR = Path("/usr/local/lib/pf-slurm/bin")  # sacct shim written by scripts/slurm_up.sh
WORKER_ARGV = [sys.executable, "-m", "harness.execute.worker"]
OnDone = Callable[[Cell, str], None]


def record_path(folder: Path, cell: Cell) -> Path:
    return folder / f"{cell.cell_id}.parquet"


def job_path(folder: Path, cell: Cell) -> Path:
    """The cell's job file, in the spec folder's private job folder (never in the results folder: a job
    file says what to run and where to write)."""
    return jobs_folder(folder) / f"{cell.cell_id}.json"


def check_record(path: Path, cell: Cell | None = None) -> str | None:
    """Why the record file at ``path`` cannot stand for ``cell`` (None: it can). A missing file is a reason.
    Verifies the file (harness.records.read_records) and that it holds this cell's spec and systems."""
    if not os.path.lexists(path):
        return "no record"
    try:
        df = read_records(path)
    except InvalidRecord as e:
        return str(e)
    if cell is not None:
        if set(df["spec"]) != {cell.spec}:
            return f"{path}: holds spec {sorted(set(df['spec']))[0]!r:.60}, not {cell.spec!r}"
        if not set(df["system"]) <= set(cell.systems):
            return f"{path}: holds systems {sorted(set(df['system']))!r:.80}, not the cell's {list(cell.systems)}"
    return None


def recorded_status(path: Path, cell: Cell | None = None) -> str | None:
    """The status of an existing record file that passes :func:`check_record`, else None."""
    if check_record(path, cell) is not None:
        return None
    return cell_status(read_records(path))


def _tail(path: Path, limit: int = 4000) -> str:
    """The last ``limit`` bytes of a log file (never through a link, never more than that read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        fh.seek(max(0, os.fstat(fd).st_size - limit))
        return fh.read(limit).decode(errors="replace")


def _finish(cell: Cell, rpath: Path, status: str, error: str) -> str:
    """Write status rows for a cell whose worker left no record; keep a record the worker did write."""
    existing = recorded_status(rpath, cell)
    if existing is not None:
        return existing
    write_records(rpath, failed_records(cell, status, error), root=rpath.parent.parent)
    return status


class DebugExecutor:
    """In-process, one cell after another (no timeouts: a hung cell hangs the sweep)."""

    name = "debug"

    def run(self, cells: list[Cell], folder: Path, on_done: OnDone) -> None:
        for cell in cells:
            on_done(cell, run_job(cell, record_path(folder, cell)))


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

    def _start(self, cell: Cell, folder: Path) -> tuple[subprocess.Popen, float]:
        jpath = write_job(job_path(folder, cell), cell, record_path(folder, cell))
        logs, root = folder / "_logs", folder.parent
        argv = [*WORKER_ARGV, str(jpath)]
        if cell.world_size > 1:  # one worker per local rank (loopback only); rank 0 writes the record
            argv = local_ranks_argv(cell.world_size, "harness.execute.worker", [str(jpath)])
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


class _JobStopped(BaseException):
    """Raised from submitit's signal handler when Slurm stops the job (not an Exception, so the runner's
    per-system error handling cannot swallow it)."""


class CellJob(submitit.helpers.Checkpointable):
    """The Slurm job body: run one cell from its job file. On preemption submitit calls ``checkpoint`` and
    requeues this same call (a cell restarts from scratch: it has no state worth saving); at the time
    limit (``slurm_max_num_timeout=0``) it does not requeue and the cell is recorded as ``timeout``."""

    def __call__(self, job_file: str) -> str:
        cell, rpath = read_job(job_file)
        sig = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), signal.SIGUSR2)
        submitit_handler = signal.getsignal(sig)

        def on_signal(signum, frame) -> None:
            try:
                if callable(submitit_handler):
                    submitit_handler(signum, frame)  # requeues (and exits) on preemption
            except submitit.core.utils.UncompletedJobError as e:
                raise _JobStopped(str(e)) from None

        signal.signal(sig, on_signal)
        if cell.world_size > 1:  # this task is one rank of the cell's multi-task job
            export_slurm_rank_env()
        try:
            return run_job(cell, rpath)
        except _JobStopped as e:
            status = "timeout" if "timed-out" in str(e) else "error"
            if os.environ.get("RANK", "0") == "0":
                write_records(
                    rpath,
                    failed_records(cell, status, f"Slurm stopped the job: {e}"),
                    root=rpath.parent.parent,
                )
            return status


def _squeue_ids() -> set[str] | None:
    try:
        out = subprocess.run(["squeue", "-h", "-r", "-o", "%i"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return set(out.stdout.split()) if out.returncode == 0 else None


class SlurmExecutor:
    """One submitit job array per sweep; waits with a deadline, never forever."""

    name = "slurm"

    def __init__(
        self,
        settings: ExecutorSettings,
        max_jobs: int | None = None,
        poll_s: float = 2.0,
        wait_timeout_s: float | None = None,
        gone_grace_s: float = 60.0,
    ) -> None:
        self.settings = settings
        self.max_jobs = max_jobs or settings.max_jobs
        self.poll_s = poll_s
        self.wait_timeout_s = wait_timeout_s
        self.gone_grace_s = gone_grace_s
        path = os.environ.get("PATH", "").split(os.pathsep)
        if SLURM_SHIM_DIR.is_dir() and str(SLURM_SHIM_DIR) not in path and trusted_dir(SLURM_SHIM_DIR):
            os.environ["PATH"] = os.pathsep.join([str(SLURM_SHIM_DIR), *path])

    def _executor(self, folder: Path, name: str, ranks: int = 1) -> submitit.AutoExecutor:
        """A submitit executor for cells of ``ranks`` ranks: one task per rank over ``settings.nodes``."""
        s = self.settings
        if ranks > 1 and ranks % s.nodes:
            raise ValueError(f"a cell of {ranks} ranks does not spread evenly over executor.nodes={s.nodes}")
        timeout_min = max(1, math.ceil(s.timeout_min))
        jobs = jobs_folder(folder) / "slurm"  # submitit's pickles: private, never in the results folder
        try:
            ex = submitit.AutoExecutor(folder=jobs, cluster="slurm", slurm_max_num_timeout=0)
        except Exception as e:
            raise RuntimeError(
                f"--executor slurm needs a Slurm client (sbatch) on PATH: {e}; "
                "for a local cluster run `bash scripts/slurm_up.sh`"
            ) from e
        params = dict(
            name=name,
            timeout_min=timeout_min,
            nodes=s.nodes,
            cpus_per_task=s.cpus_per_task,
            mem_gb=s.mem_gb,
            slurm_array_parallelism=self.max_jobs,
            slurm_signal_delay_s=min(90, max(15, timeout_min * 15)),
        )
        if s.gpus_per_node:
            params["gpus_per_node"] = s.gpus_per_node
        if s.partition:
            params["slurm_partition"] = s.partition
        if ranks == 1:
            params["tasks_per_node"] = 1
        else:  # --ntasks, not --ntasks-per-node: Slurm checks the latter against the node's CPUs
            params["slurm_additional_parameters"] = {
                "ntasks": ranks,
                **({"overcommit": True} if s.overcommit else {}),
            }
        ex.update_parameters(**params)
        return ex

    def run(self, cells: list[Cell], folder: Path, on_done: OnDone) -> None:
        if not cells:
            return
        # One job array per world size: a multi-rank cell is one multi-task job (one task per rank).
        by_ranks: dict[int, list[Cell]] = {}
        for cell in cells:
            by_ranks.setdefault(cell.world_size, []).append(cell)
        cells, jobs = [], []
        try:
            for ranks, group in sorted(by_ranks.items()):
                files = [str(write_job(job_path(folder, c), c, record_path(folder, c))) for c in group]
                ex = self._executor(folder, f"pf-{group[0].spec}", ranks)
                jobs += ex.map_array(CellJob(), files)
                cells += group
        except Exception:
            for job in jobs:  # a later array failed to submit: leave nothing running
                job.cancel(check=False)
            raise
        waves = math.ceil(len(cells) / self.max_jobs)
        budget = self.wait_timeout_s or waves * max(1, math.ceil(self.settings.timeout_min)) * 60 + 300
        deadline = time.monotonic() + budget
        pending = dict(zip([j.job_id for j in jobs], zip(cells, jobs, strict=True), strict=True))
        gone_since: dict[str, float] = {}
        while pending:
            queued = _squeue_ids()
            now = time.monotonic()
            for jid, (cell, job) in list(pending.items()):
                rpath = record_path(folder, cell)
                status = recorded_status(rpath)
                if status is None and job.done():
                    status = self._from_job(cell, job, rpath)
                if status is None and queued is not None and jid not in queued:
                    gone_since.setdefault(jid, now)
                    if now - gone_since[jid] > self.gone_grace_s:
                        status = _finish(
                            cell,
                            rpath,
                            "error",
                            f"job {jid} left the queue without a record; "
                            f"see {job.paths.stderr}\n{_tail(job.paths.stderr)}",
                        )
                if status is not None:
                    del pending[jid]
                    on_done(cell, status)
            if pending and time.monotonic() > deadline:
                for jid, (cell, job) in pending.items():
                    job.cancel(check=False)
                    _finish(
                        cell,
                        record_path(folder, cell),
                        "timeout",
                        f"job {jid} not finished after waiting {budget:.0f} s; cancelled",
                    )
                    on_done(cell, recorded_status(record_path(folder, cell)) or "timeout")
                return
            if pending:
                time.sleep(self.poll_s)

    @staticmethod
    def _from_job(cell: Cell, job: submitit.Job, rpath: Path) -> str:
        try:
            job.results()  # one result per task (rank)
        except Exception as e:
            text = str(e)
            state = job.state
            status = "timeout" if ("timed-out" in text or state == "TIMEOUT") else "error"
            status = "oom" if state == "OUT_OF_MEMORY" else status
            return _finish(cell, rpath, status, f"slurm job {job.job_id} ({state}): {text[-4000:]}")
        return recorded_status(rpath) or _finish(cell, rpath, "error", f"job {job.job_id} wrote no record")


def make_executor(kind: str, settings: ExecutorSettings, max_jobs: int | None = None):
    """The executor named ``kind`` (one of EXECUTORS)."""
    if kind == "debug":
        return DebugExecutor()
    if kind == "local":
        return LocalExecutor(max_jobs=max_jobs or settings.max_jobs)
    if kind == "slurm":
        return SlurmExecutor(settings, max_jobs=max_jobs)
    raise ValueError(f"unknown executor {kind!r}; allowed: {', '.join(EXECUTORS)}")
