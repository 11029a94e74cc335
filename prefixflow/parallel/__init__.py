"""Parallelism for PrefixFlow on torch.distributed, in TorchTitan's shape and order.

>>> from prefixflow.parallel import init_distributed, parallelize
>>> from prefixflow.parallel.dp import train_step
>>> device = init_distributed("cpu")                      # under torchrun: gloo on CPU, NCCL on CUDA
>>> model = apply_prefixflow(build_model(...))            # the same model object for both systems
>>> parallelize(model, {"tp": 2, "dp_shard": 2})          # TP -> AC -> compile -> FSDP2, TorchTitan's order
>>> stats = train_step(model, groups)                     # DP placement; gradients reduced once
>>> optimizer.step()

One file per parallelism: ``mesh.py`` (degrees, process group, device mesh), ``tp.py`` (TorchTitan's TP
plans), ``fsdp.py`` (FSDP2 under the three phases), ``dp.py`` (group placement, split groups, gradient
sync), ``pp.py`` (cuts the model into pipeline stages before everything else; the stage programs switch
phases stage-locally), ``cp.py`` with ``sequence.py`` (context parallelism, applied right after TP as TorchTitan
does). ``ep.py``: MoE layers under TP and expert parallelism, which borrows ranks from ``dp_shard x cp x tp``
(TorchTitan's sparse mesh), applied with the dense TP plans.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..model.apply import AC_MODES, apply_ac, runtime_of
from ..moe import is_moe
from ..schedule.host import on_host
from .mesh import MESH_DIMS, ParallelDims, backend_for, build_mesh, init_distributed

__all__ = [
    "MESH_DIMS",
    "SUPPORTED_DIMS",
    "ParallelDims",
    "ParallelState",
    "backend_for",
    "build_mesh",
    "check_supported",
    "init_distributed",
    "parallel_state",
    "parallelize",
]

# Dimensions parallelize() applies.
SUPPORTED_DIMS = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")


@dataclass
class ParallelState:
    """What ``parallelize`` records on the model's runtime (``runtime_of(model).parallel``)."""

    dims: ParallelDims
    mesh: DeviceMesh
    device: torch.device
    fsdp: bool
    expert_mesh: DeviceMesh | None = None  # (efsdp, ep) under expert parallelism
    compute_dtype: torch.dtype | None = None  # what blocks compute in (FSDP2's param_dtype, else the params')
    model_group: dist.ProcessGroup | None = None  # every rank of ``mesh`` (collective verdicts: grad_guard)

    def coordinate(self, name: str) -> int:
        """This rank's index along mesh dimension ``name`` (``batch`` = its data-parallel rank)."""
        return self.mesh[name].get_local_rank()

    def peers(self, name: str) -> list[int]:
        """Global ranks of the mesh dimension ``name`` that this rank belongs to, in coordinate order."""
        with on_host():  # the mesh's rank table is real even under an estimate's fake tensors
            return [int(r) for r in self.mesh[name].mesh.flatten().tolist()]


def parallel_state(model: nn.Module) -> ParallelState | None:
    """The model's ``ParallelState`` (None for a single-process model)."""
    return runtime_of(model, create=True).parallel


def _model_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The process group of every rank of ``mesh``: the world when the mesh spans it (no new group)."""
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    return mesh.get_group() if mesh.ndim == 1 else mesh._flatten().get_group()


def check_supported(dims: ParallelDims) -> None:
    """Raise ``ValueError`` for a dimension ``parallelize`` cannot apply yet."""
    for name in MESH_DIMS:
        if getattr(dims, name) > 1 and name not in SUPPORTED_DIMS:
            raise ValueError(
                f"{name}={getattr(dims, name)} is not supported yet; parallelize applies "
                f"{', '.join(SUPPORTED_DIMS)}"
            )


def parallelize(
    model: nn.Module,
    dims: ParallelDims | dict,
    *,
    ac: str = "none",
    compile: bool = False,
    fsdp=None,
    mesh: DeviceMesh | None = None,
    cp_prefetch: bool = True,
    pp_switching: str = "stage_local",
) -> nn.Module:
    """Apply, in TorchTitan's order: PP (cut into stages), TP (TorchTitan's plans), CP, activation
    checkpointing, per-block compile, then FSDP2/HSDP over ``dp_replicate x dp_shard`` (x ``cp``: TorchTitan
    folds CP into FSDP; without FSDP the CP hook all-reduces the gradients), or, with ``dp_replicate`` only, a
    gradient all-reduce once per step. Returns the model: with ``pp`` > 1 this rank's stage, a new module;
    otherwise the model itself, changed in place.

    ``dims``: a :class:`ParallelDims` or a mapping of TorchTitan names. The model must be wrapped by
    ``apply_prefixflow`` and live on this rank's device; the process group must exist
    (:func:`init_distributed`). ``ac``: ``none``/``selective``/``full``; ``fsdp``: an ``FSDPConfig``;
    ``cp_prefetch``: overlap each layer's prefix K/V gather with the previous layer (else on demand);
    ``pp_switching``: ``"stage_local"`` or ``"barrier"`` (global A | B | C barriers). A model of another
    family (a Hugging Face model) takes ``dp_shard`` only, with the units its adapter names
    (``ModelAdapter.fsdp_units``).
    """
    dims = ParallelDims.of(dims)
    check_supported(dims)
    if dims.ep > 1:
        from .ep import check_ep_degree

        check_ep_degree(model, dims)
    if ac not in AC_MODES:
        raise ValueError(f"ac {ac!r} unknown; valid: {AC_MODES}")
    runtime = runtime_of(model)  # PrefixFlow's SDPA wrappers go in first: TP hooks attach to them
    if runtime.adapter.name != "torchtitan":
        titan_only = [n for n in MESH_DIMS if n != "dp_shard" and getattr(dims, n) > 1]
        if titan_only:
            raise ValueError(
                f"{', '.join(f'{n}={getattr(dims, n)}' for n in titan_only)}: parallelize applies TorchTitan's "
                f"plans to TorchTitan models; a {runtime.adapter.name} model takes dp_shard (FSDP2) only"
            )
    if parallel_state(model) is not None:
        raise ValueError("parallelize was already applied to this model")
    if dims.cp > 1 and is_moe(model):
        raise ValueError(
            f"cp={dims.cp} with MoE layers is not supported yet: routing replay plans whole sequences, not CP "
            "shards; train MoE models with cp=1 (tp, ep, dp and pp work)"
        )
    device = next(model.parameters()).device
    mesh = mesh if mesh is not None else build_mesh(dims, device)
    if dims.pp > 1:
        from .pp import apply_pp

        model = apply_pp(model, mesh["pp"], switching=pp_switching)
    if dims.tp > 1:
        from .tp import apply_tp

        apply_tp(model, mesh["tp"])
    expert_mesh = None
    if dims.ep > 1 or (dims.tp > 1 and is_moe(model)):
        from .ep import apply_moe_parallel, build_expert_mesh

        expert_mesh = build_expert_mesh(dims, device) if dims.ep > 1 else None
        tp_mesh = mesh["tp"] if dims.tp > 1 else None
        apply_moe_parallel(model, dims, tp_mesh, None if expert_mesh is None else expert_mesh["ep"])
    fsdp_over_cp = dims.cp > 1 and dims.dp_shard > 1
    if dims.cp > 1:
        from .cp import apply_cp

        apply_cp(model, mesh["cp"], prefetch=cp_prefetch, reduce_grads=not fsdp_over_cp)
    apply_ac(model, ac)
    if compile:
        from ..model.compile import apply_compile

        apply_compile(model)
    if dims.dp_shard > 1:
        from .fsdp import FSDPConfig, apply_fsdp

        shard = "fsdp" if fsdp_over_cp else "dp_shard"  # fsdp = dp_shard x cp
        names = ("dp_replicate", shard) if dims.dp_replicate > 1 else (shard,)
        experts = None if expert_mesh is None else expert_mesh["efsdp"]
        apply_fsdp(model, mesh[names], fsdp or FSDPConfig(), expert_mesh=experts)
    elif fsdp is not None:
        raise ValueError("an FSDP config needs dp_shard > 1")
    param_dtype = getattr(fsdp, "param_dtype", None) if dims.dp_shard > 1 else None
    compute_dtype = param_dtype or next(model.parameters()).dtype
    runtime_of(model, create=True).parallel = ParallelState(
        dims, mesh, device, dims.dp_shard > 1, expert_mesh, compute_dtype, _model_group(mesh)
    )
    return model
