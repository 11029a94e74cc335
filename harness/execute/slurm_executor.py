"""The ``slurm`` executor: one submitit job array per world size, a multi-rank cell one multi-task job (one
task per rank, spread evenly over ``executor.nodes``), and what it records when a job goes wrong.

A multi-node job whose node Slurm sets DOWN mid-cell (``harness.execute.slurm_nodes``) is cancelled, so that
Slurm does not requeue it behind the sweep's back, and its cell is recorded ``error`` naming the lost node;
``pf-bench sweep --retry-failed`` reruns it once the node is back.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
from pathlib import Path

import submitit

from harness.execute.jobs import read_job, write_job
from harness.execute.outcome import OnDone, finish, job_path, record_path, recorded_status, tail
from harness.execute.slurm import export_slurm_rank_env
from harness.execute.slurm_nodes import job_nodes, lost_nodes, slurmd_timeout_s
from harness.execute.worker import run_job
from harness.records import read_records, write_records
from harness.run.columns import failed_records
from harness.safe_fs import jobs_folder, trusted_dir
from harness.spec.cell import Cell
from harness.spec.schema import ExecutorSettings

__all__ = ["CellJob", "SlurmExecutor", "SLURM_SHIM_DIR"]

SLURM_SHIM_DIR = Path("/usr/local/lib/pf-slurm/bin")  # sacct shim written by scripts/slurm_up.sh


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


def _squeue_ids() -> dict[str, str] | None:
    """Every job in the queue (array tasks one by one) with its state, or None when squeue fails."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-r", "-o", "%i %T"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return dict(line.split(None, 1) for line in out.stdout.splitlines() if len(line.split()) == 2)


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

    def _nodes(self, ranks: int) -> int:
        """Nodes a cell of ``ranks`` ranks takes: ``executor.nodes`` when it has several ranks, else one."""
        return self.settings.nodes if ranks > 1 else 1

    def _executor(self, folder: Path, name: str, ranks: int = 1) -> submitit.AutoExecutor:
        """A submitit executor for cells of ``ranks`` ranks: one task per rank, ``ranks / nodes`` per node."""
        s = self.settings
        nodes = self._nodes(ranks)
        if ranks % nodes:
            raise ValueError(
                f"a cell of {ranks} ranks does not spread evenly over executor.nodes={nodes}; "
                "give layouts whose ranks are a multiple of executor.nodes"
            )
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
            nodes=nodes,
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
        else:  # one node: --ntasks, not --ntasks-per-node (Slurm checks the latter against the node's CPUs)
            extra: dict = {"ntasks": ranks, **({"overcommit": True} if s.overcommit else {})}
            if nodes > 1:
                extra["ntasks_per_node"] = ranks // nodes
            params["slurm_additional_parameters"] = extra
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
        self._nodes_of: dict[str, list[str]] = {}
        self._failed_since: dict[str, float] = {}
        self._settle_s: float | None = None
        while pending:
            queued = _squeue_ids()
            now = time.monotonic()
            self._lost_now: dict[str, list[str]] = {}  # node -> lost_nodes([node]), asked once per poll
            for jid, (cell, job) in list(pending.items()):
                rpath = record_path(folder, cell)
                status = recorded_status(rpath)
                if self._nodes(cell.world_size) > 1 and status != "ok":
                    status = self._multi_node(cell, job, rpath, status, queued, now)
                    if status is None and jid in self._failed_since:
                        continue  # rank 0 failed; waiting for Slurm to say whether a node was lost
                if status is None and job.done():
                    status = self._from_job(cell, job, rpath)
                if status is None and queued is not None and jid not in queued:
                    gone_since.setdefault(jid, now)
                    if now - gone_since[jid] > self.gone_grace_s:
                        status = finish(
                            cell,
                            rpath,
                            "error",
                            f"job {jid} left the queue without a record; "
                            f"see {job.paths.stderr}\n{tail(job.paths.stderr)}",
                        )
                if status is not None:
                    del pending[jid]
                    on_done(cell, status)
            if pending and time.monotonic() > deadline:
                for jid, (cell, job) in pending.items():
                    job.cancel(check=False)
                    finish(
                        cell,
                        record_path(folder, cell),
                        "timeout",
                        f"job {jid} not finished after waiting {budget:.0f} s; cancelled",
                    )
                    on_done(cell, recorded_status(record_path(folder, cell)) or "timeout")
                return
            if pending:
                time.sleep(self.poll_s)

    def _multi_node(
        self, cell: Cell, job: submitit.Job, rpath: Path, status: str | None, queued: dict | None, now: float
    ) -> str | None:
        """A multi-node job not (yet) ``ok``: the cell's status once it is settled, else None (keep polling).

        A node Slurm holds lost fails the cell now, naming the node (the job is cancelled). A record that rank
        0 wrote with a failure while the job still runs waits for Slurm's verdict on the nodes: at most
        ``SlurmdTimeout`` and a minute, then the job is cancelled and the record stands."""
        jid = job.job_id
        in_queue = queued is None or jid in queued
        if not self._nodes_of.get(jid) and not (queued is not None and queued.get(jid) == "PENDING"):
            self._nodes_of[jid] = job_nodes(jid)  # once it has started (or ended)
        lost: list[str] = []
        for node in self._nodes_of.get(jid, []):
            if node not in self._lost_now:
                self._lost_now[node] = lost_nodes([node])
            lost += self._lost_now[node]
        if lost:
            if in_queue:
                job.cancel(check=False)
            return self._record_lost(cell, job, rpath, lost)
        if status is None:
            return None
        if in_queue:
            first = self._failed_since.setdefault(jid, now)
            if self._settle_s is None:
                self._settle_s = slurmd_timeout_s() + 60
            if now - first <= self._settle_s:
                return None
            job.cancel(check=False)
        self._failed_since.pop(jid, None)
        return status

    @staticmethod
    def _record_lost(cell: Cell, job: submitit.Job, rpath: Path, lost: list[str]) -> str:
        """Record the cell ``error``: Slurm lost ``lost`` mid-cell (what rank 0 reported follows, if anything)."""
        try:
            errors = [e for e in read_records(rpath)["error"].dropna() if e]
        except Exception:  # no record, or not one the cell can keep
            errors = []
        said = (
            errors[0].strip()[-1500:]
            if errors
            else f"no record; see {job.paths.stderr}\n{tail(job.paths.stderr, 1500)}"
        )
        names = ", ".join(lost)
        message = f"node {names} lost mid-cell: Slurm set it down and ended job {job.job_id}. Rank 0: {said}"
        write_records(rpath, failed_records(cell, "error", message), root=rpath.parent.parent)
        return "error"

    @staticmethod
    def _from_job(cell: Cell, job: submitit.Job, rpath: Path) -> str:
        try:
            job.results()  # one result per task (rank)
        except Exception as e:
            text = str(e)
            state = job.state
            status = "timeout" if ("timed-out" in text or state == "TIMEOUT") else "error"
            status = "oom" if state == "OUT_OF_MEMORY" else status
            return finish(cell, rpath, status, f"slurm job {job.job_id} ({state}): {text[-4000:]}")
        return recorded_status(rpath) or finish(cell, rpath, "error", f"job {job.job_id} wrote no record")
