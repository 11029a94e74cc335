"""Start the ranks of a single-node job with every socket on loopback: this project's small ``torchrun``.

``torchrun --standalone`` hosts its rendezvous and worker stores on ``*:port`` (every interface). Here the
launcher binds a socket to ``127.0.0.1`` itself, hosts the job's ``TCPStore`` on it (``master_listen_fd``)
and starts one process per rank with the environment torchrun gives (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``) plus ``TORCHELASTIC_USE_AGENT_STORE=True``: every
rank joins that store as a client (``init_method="env://"`` unchanged, gloo and NCCL alike) and no rank
opens a store of its own. ``GLOO_SOCKET_IFNAME=lo`` / ``NCCL_SOCKET_IFNAME=lo`` keep the collectives'
sockets on loopback.

Supervision follows torchrun: the ranks share the launcher's stdout/stderr; the first rank to fail stops the
others (SIGTERM, then SIGKILL) and its exit status is the launcher's; a signal to the launcher stops them
too, and each rank dies with the launcher (``PR_SET_PDEATHSIG``), so no rank outlives it.

    python -m harness.execute.local_ranks --nproc-per-node=N [-m] MODULE_OR_SCRIPT [ARGS...]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import timedelta

__all__ = ["LOOPBACK", "loopback_env", "main", "rank_env"]

LOOPBACK = "127.0.0.1"
STOP_GRACE_S = 10.0


def loopback_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the collectives pinned to the loopback interface (gloo and NCCL)."""
    return {**env, "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def rank_env(base: dict[str, str], rank: int, world: int, port: int) -> dict[str, str]:
    """The environment of local rank ``rank`` of ``world``, joining the launcher's store on ``port``."""
    return {
        **loopback_env(base),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": LOOPBACK,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # join the launcher's store; rank 0 opens none
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }


def _loopback_listener() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, 0))
    sock.listen(128)
    return sock


_prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before any fork


def _die_with_launcher() -> None:
    """preexec_fn: SIGKILL this rank when the launcher dies (Linux PR_SET_PDEATHSIG)."""
    _prctl(1, signal.SIGKILL, 0, 0, 0)


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every rank still running, then SIGKILL those left after the grace period."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _exit_status(code: int) -> int:
    return 128 - code if code < 0 else code  # killed by signal N -> 128 + N, as a shell reports it


def supervise(procs: list[subprocess.Popen], poll_s: float = 0.1) -> int:
    """Wait for every rank; the first to fail stops the rest. Returns 0 or the failing rank's status."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            print(f"[local_ranks] rank {rank} exited with {code}: stopping the other ranks", file=sys.stderr)
            _stop(procs)
            return _exit_status(code)
        if all(c == 0 for c in codes):
            return 0
        time.sleep(poll_s)


def _on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)


def launch(nproc: int, target: str, args: Sequence[str], module: bool, timeout_s: float = 1800) -> int:
    """Run ``nproc`` ranks of ``python [-m] target args`` on this machine, loopback only; their status."""
    if nproc < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {nproc}")
    from torch.distributed import TCPStore

    listener = _loopback_listener()
    port = listener.getsockname()[1]
    store = TCPStore(  # noqa: F841 (kept alive: the ranks' rendezvous)
        LOOPBACK,
        port,
        None,
        True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listener.fileno(),
    )
    argv = [sys.executable, "-u", *(["-m"] if module else []), target, *args]
    procs: list[subprocess.Popen] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    try:
        for rank in range(nproc):
            env = rank_env(dict(os.environ), rank, nproc, port)
            procs.append(
                subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, preexec_fn=_die_with_launcher)
            )
        return supervise(procs)
    finally:
        _stop(procs)
        listener.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.execute.local_ranks", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("-m", dest="module", action="store_true", help="run TARGET as a module")
    parser.add_argument("target")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    if ns.nproc_per_node < 1:
        parser.error(f"--nproc-per-node must be >= 1, got {ns.nproc_per_node}")
    return launch(ns.nproc_per_node, ns.target, ns.args, ns.module)


if __name__ == "__main__":
    raise SystemExit(main())
