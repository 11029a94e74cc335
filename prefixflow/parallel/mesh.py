"""Parallel degrees under TorchTitan's names, the process group and the device mesh.

``ParallelDims`` holds one degree per TorchTitan mesh dimension (``dp_replicate``, ``dp_shard``, ``cp``,
``tp``, ``pp``, ``ep``). ``build_mesh`` lays the world out as TorchTitan's dense mesh
``(pp, dp_replicate, dp_shard, cp, tp)`` and adds its flattened views:

- ``batch`` = ``dp_replicate x dp_shard``: the ranks that train different rollout groups (DP placement);
- ``fsdp``  = ``dp_shard x cp``: the ranks FSDP2 shards parameters over (TorchTitan folds CP into FSDP);
- ``loss``  = ``dp_replicate x dp_shard x cp``: the ranks whose gradients and losses are summed.

Expert parallelism borrows ranks from ``dp_shard x cp x tp`` (TorchTitan's separate sparse mesh), so ``ep``
is not a factor of the world size. The backend follows the device: gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = [
    "MESH_DIMS",
    "ParallelDims",
    "backend_for",
    "init_distributed",
    "build_mesh",
]

MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
DENSE_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # TorchTitan's dense mesh, outermost first
FLATTENED = {
    "batch": ("dp_replicate", "dp_shard"),
    "fsdp": ("dp_shard", "cp"),
    "loss": ("dp_replicate", "dp_shard", "cp"),
}


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each TorchTitan mesh dimension; ``world_size`` is their product without ``ep``."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel degree {f.name} must be an int >= 1, got {value!r}")
        if self.ep > 1 and (self.dp_shard * self.cp * self.tp) % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide dp_shard*cp*tp={self.dp_shard * self.cp * self.tp} "
                f"(expert parallelism borrows those ranks, as in TorchTitan); e.g. dp_shard={self.ep}, ep={self.ep} "
                f"(pf-bench: --dp-shard {self.ep} --ep {self.ep})"
            )

    @classmethod
    def of(cls, dims: ParallelDims | dict | None = None, **kwargs) -> ParallelDims:
        """``ParallelDims`` from an instance, a mapping of TorchTitan names, or keywords."""
        if isinstance(dims, ParallelDims):
            if kwargs:
                raise TypeError("give either a ParallelDims or keyword degrees, not both")
            return dims
        given = {**dict(dims or {}), **kwargs}
        unknown = sorted(set(given) - set(MESH_DIMS))
        if unknown:
            raise ValueError(f"unknown parallel dimension(s) {unknown}; TorchTitan's names are {MESH_DIMS}")
        return cls(**given)

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_DIMS}

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def batch(self) -> int:
        """Data-parallel degree: ranks that train different groups."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1

    @property
    def label(self) -> str:
        """A short layout name, e.g. ``tp2-dp_shard2`` (``single`` when every degree is 1)."""
        parts = [f"{n}{getattr(self, n)}" for n in MESH_DIMS if getattr(self, n) > 1]
        return "-".join(parts) or "single"


def backend_for(device: torch.device | str) -> str:
    """The collective backend for a device type: NCCL on CUDA, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed(device: torch.device | str = "cpu") -> torch.device:
    """Join the process group that ``torchrun`` (or a Slurm task) describes in the environment.

    Picks the backend from ``device``; on CUDA it also selects ``cuda:LOCAL_RANK``. Idempotent. Returns the
    device this rank computes on.
    """
    device = torch.device(device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(
                f"no process group and no {missing} in the environment: start the ranks with "
                "`python -m harness.local_ranks` (loopback only) or torchrun, or call "
                "torch.distributed.init_process_group yourself"
            )
        dist.init_process_group(backend=backend_for(device))
    return device


def build_mesh(dims: ParallelDims, device: torch.device | str = "cpu") -> DeviceMesh:
    """The world as TorchTitan's dense mesh ``(pp, dp_replicate, dp_shard, cp, tp)`` with the flattened
    ``batch``, ``fsdp`` and ``loss`` views. Needs an initialised process group of ``dims.world_size`` ranks."""
    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs an initialised process group (see init_distributed)")
    world = dist.get_world_size()
    if world != dims.world_size:
        raise ValueError(
            f"parallel layout {dims.as_dict()} needs pp*dp_replicate*dp_shard*cp*tp = {dims.world_size} ranks, "
            f"but the process group has {world}"
        )
    shape = tuple(getattr(dims, name) for name in DENSE_ORDER)
    mesh = init_device_mesh(torch.device(device).type, shape, mesh_dim_names=DENSE_ORDER)
    for flat, parts in FLATTENED.items():
        mesh[parts]._flatten(flat)
    return mesh
