"""Inside a Slurm task: the environment ``torch.distributed`` reads (one task per rank, submitit)."""

from __future__ import annotations

import os

__all__ = ["export_slurm_rank_env"]


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
