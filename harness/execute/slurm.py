"""Inside a Slurm task: the environment ``torch.distributed`` reads (one task per rank, submitit), and the
job's rendezvous store on the one address it should listen on.

The store's address (``MASTER_ADDR``) is loopback when the job has one node, and otherwise the address of the
job's first node (the first host of ``SLURM_JOB_NODELIST``, where Slurm starts task 0), resolved here once.
Rank 0 hosts the ``TCPStore`` on a socket it binds to exactly that address and port (``MASTER_PORT``:
submitit's, derived from the job id, or the job's own ``MASTER_PORT``); every rank, rank 0 included, joins it
as a client (``TORCHELASTIC_USE_AGENT_STORE``), so no rank opens a store on every interface.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

__all__ = ["export_slurm_rank_env", "rendezvous_address"]

LOOPBACK = "127.0.0.1"
STORE_TIMEOUT_S = 1800
_store = None  # rank 0's TCPStore server: kept alive for the life of the task


def rendezvous_address(hostnames: list[str]) -> str:
    """The store's address for a job on ``hostnames`` (its nodelist, task 0's node first): loopback for one
    node, else the first node's address. Raises ``RuntimeError`` naming the node when it does not resolve."""
    if len(hostnames) <= 1:
        return LOOPBACK
    first = hostnames[0]
    try:
        infos = socket.getaddrinfo(first, None, type=socket.SOCK_STREAM)
    except OSError as e:
        raise RuntimeError(
            f"the job's first node {first!r} (the rendezvous host) does not resolve to an address: {e}; "
            "every node must resolve the others' names (DNS or /etc/hosts), see docs/harness.md"
        ) from None
    addrs = [info[4][0] for info in infos]
    usable = [a for a in addrs if not _is_loopback(a)]
    if not usable:
        raise RuntimeError(
            f"the job's first node {first!r} resolves to loopback only ({', '.join(addrs)}): the other nodes "
            "could not reach its store; map the node name to its cluster address (DNS or /etc/hosts)"
        )
    return usable[0]


def _is_loopback(addr: str) -> bool:
    import ipaddress

    return ipaddress.ip_address(addr.split("%")[0]).is_loopback


def _host_store(addr: str, port: int, world: int) -> None:
    """Rank 0: listen on ``addr:port`` only and host the job's store there."""
    global _store
    from torch.distributed import TCPStore

    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((addr, port))
    except OSError as e:
        sock.close()
        raise RuntimeError(
            f"rank 0 cannot listen on the rendezvous address {addr}:{port} ({e}); task 0 must run on the "
            "job's first node and the port must be free (set MASTER_PORT in the job's environment)"
        ) from None
    sock.listen(128)
    _store = (
        sock,
        TCPStore(
            addr,
            port,
            world,
            True,
            timeout=timedelta(seconds=STORE_TIMEOUT_S),
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        ),
    )


def export_slurm_rank_env() -> None:
    """Inside one task of a Slurm multi-task job (one task per rank, submitit): set ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` for ``torch.distributed`` and, on rank 0,
    host the store on ``MASTER_ADDR`` alone. A one-node job keeps all its traffic on loopback."""
    import submitit

    job = submitit.JobEnvironment()
    env = submitit.helpers.TorchDistributedEnvironment().export(
        set_cuda_visible_devices=False, overwrite=True
    )
    addr = rendezvous_address(job.hostnames if job.num_nodes > 1 else [])
    if addr == LOOPBACK:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ.update(
        MASTER_ADDR=addr,
        TORCHELASTIC_USE_AGENT_STORE="True",  # env:// joins the store below as a client
        TORCHELASTIC_RESTART_COUNT="0",
    )
    if env.rank == 0 and _store is None:
        _host_store(addr, env.master_port, env.world_size)
