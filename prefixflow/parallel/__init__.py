"""Parallelism for PrefixFlow on torch.distributed, in TorchTitan's shape and order.

>>> from prefixflow.parallel import init_distributed, parallelize, train_step
>>> device = init_distributed("cpu")                      # under torchrun: gloo on CPU, NCCL on CUDA
>>> model = apply_prefixflow(build_model(...))            # the same model object for both systems
>>> parallelize(model, {"tp": 2, "dp_shard": 2})          # TP -> AC -> compile -> FSDP2, TorchTitan's order
>>> stats = train_step(model, groups)                     # DP placement; gradients reduced once
>>> optimizer.step()

One file per parallelism: ``mesh.py`` (degrees, process group, device mesh), ``tp.py`` (TorchTitan's TP
plans), ``fsdp.py`` (FSDP2 under the three phases), ``dp.py`` (group placement, split groups, gradient
sync). Context and pipeline parallelism slot in as ``cp.py`` (applied right after TP, as TorchTitan does)
and ``pp.py`` (splits the model into stages before everything else); expert parallelism borrows ranks
from ``dp_shard x cp x tp``. Until they exist, ``parallelize`` rejects ``cp``/``pp``/``ep`` > 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..apply import AC_MODES, apply_ac, runtime_of
from .mesh import MESH_DIMS, ParallelDims, backend_for, build_mesh, init_distributed

__all__ = [
    "MESH_DIMS",
    "SUPPORTED_DIMS",
    "ParallelDims",
    "ParallelState",
    "backend_for",
    "build_mesh",
    "init_distributed",
    "parallel_state",
    "parallelize",
]

# Dimensions parallelize() applies today. cp/pp (issue 9) and ep (MoE) join this set when their apply_*
# step lands below.
SUPPORTED_DIMS = ("dp_replicate", "dp_shard", "tp")


@dataclass
class ParallelState:
    """What ``parallelize`` attaches to the model (``model.prefixflow_parallel``)."""

    dims: ParallelDims
    mesh: DeviceMesh
    device: torch.device
    fsdp: bool

    def coordinate(self, name: str) -> int:
        """This rank's index along mesh dimension ``name`` (``batch`` = its data-parallel rank)."""
        return self.mesh[name].get_local_rank()

    def peers(self, name: str) -> list[int]:
        """Global ranks of the mesh dimension ``name`` that this rank belongs to, in coordinate order."""
        return [int(r) for r in self.mesh[name].mesh.flatten().tolist()]


def parallel_state(model: nn.Module) -> ParallelState | None:
    """The model's ``ParallelState`` (None for a single-process model)."""
    return getattr(model, "prefixflow_parallel", None)


def _check_supported(dims: ParallelDims) -> None:
    for name in MESH_DIMS:
        if getattr(dims, name) > 1 and name not in SUPPORTED_DIMS:
            raise ValueError(
                f"{name}={getattr(dims, name)} is not supported yet; parallelize applies "
                f"{', '.join(SUPPORTED_DIMS)} (context/pipeline parallelism: prefixflow/parallel/cp.py, pp.py)"
            )


def parallelize(
    model: nn.Module,
    dims: ParallelDims | dict,
    *,
    ac: str = "none",
    compile: bool = False,
    fsdp=None,
    mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Apply, in TorchTitan's order: TP (TorchTitan's plans), [CP], activation checkpointing, per-block
    compile, then FSDP2/HSDP over ``dp_replicate x dp_shard`` (or, with ``dp_replicate`` only, a gradient
    all-reduce once per step). In place; returns the model.

    ``dims``: a :class:`ParallelDims` or a mapping of TorchTitan names. The model must be wrapped by
    ``apply_prefixflow`` and live on this rank's device; the process group must exist
    (:func:`init_distributed`). ``ac``: ``none``/``selective``/``full``; ``fsdp``: an ``FSDPConfig``.
    """
    dims = ParallelDims.of(dims)
    _check_supported(dims)
    if ac not in AC_MODES:
        raise ValueError(f"ac {ac!r} unknown; valid: {AC_MODES}")
    runtime = runtime_of(model)  # PrefixFlow's SDPA wrappers go in first: TP hooks attach to them
    if runtime.adapter.name != "torchtitan":
        raise ValueError(
            f"parallelize applies TorchTitan's plans to TorchTitan models; this is a {runtime.adapter.name} model"
        )
    if parallel_state(model) is not None:
        raise ValueError("parallelize was already applied to this model")
    device = next(model.parameters()).device
    mesh = mesh if mesh is not None else build_mesh(dims, device)
    if dims.tp > 1:
        from .tp import apply_tp

        apply_tp(model, mesh["tp"])
    # Context parallelism goes here (TorchTitan applies it to the attention modules right after TP).
    apply_ac(model, ac)
    if compile:
        from ..compile import apply_compile

        apply_compile(model)
    if dims.dp_shard > 1:
        from .fsdp import FSDPConfig, apply_fsdp

        names = ("dp_replicate", "dp_shard") if dims.dp_replicate > 1 else ("dp_shard",)
        apply_fsdp(model, mesh[names], fsdp or FSDPConfig())
    elif fsdp is not None:
        raise ValueError("an FSDP config needs dp_shard > 1")
    model.prefixflow_parallel = ParallelState(dims, mesh, device, fsdp=dims.dp_shard > 1)
    return model
