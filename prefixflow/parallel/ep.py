"""Expert parallelism, and MoE layers under tensor parallelism: TorchTitan's plans, on any device.

PrefixFlow needs nothing from EP (paper §4.4): the cache lives at the SDPA boundary, and routing replay
hands every MoE layer its expert ids before the layer runs. ``apply_moe_parallel`` applies TorchTitan's
MoE plans (``apply_moe_ep_tp`` with ``etp = 1``), to the layers ``apply_moe`` made replay-capable:

- TP over ``tp``: the MoE input is gathered along the sequence (``PrepareModuleInputOutput``), the router's
  gate computes replicated (``NoParallel``), shared experts run colwise/rowwise, and the output is
  reduce-scattered; without EP the routed experts shard their hidden dimension (``TensorParallel``);
- EP over ``ep`` (borrowing ``dp_shard x cp x tp`` ranks, innermost first, as TorchTitan does): each rank
  holds ``num_experts / ep`` experts (``ExpertParallel``: all-to-all dispatch and combine); when EP borrows
  the TP ranks, each TP rank dispatches its share of the tokens (``ReordererSequenceParallel``).

TorchTitan's ``ExpertParallel`` groups the received tokens by local expert with a Triton kernel, padded for
grouped GEMMs. :class:`PortableExpertParallel` keeps that path on CUDA and does the same grouping with
plain tensor ops (no padding) elsewhere, where the experts run TorchTitan's per-expert loop.

Every EP rank must run the same sequence of MoE forwards and backwards (the all-to-alls pair up):
:class:`EPSchedule` checks before each group that the EP ranks train the same system on groups with the
same number of responses and a non-empty prefix on all or none of them (pass the same ``microbatch``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInputOutput,
    RowwiseParallel,
    parallelize_module,
)
from torchtitan.distributed import NoParallel
from torchtitan.distributed.expert_parallel import (
    ExpertParallel,
    ReordererSequenceParallel,
    TensorParallel,
)

from ..group import RolloutGroup
from ..hooks import ScheduleHooks, add_hooks
from ..moe import moe_layers
from ..tree.plan import group_tree
from .mesh import ParallelDims

__all__ = [
    "PortableExpertParallel",
    "EPSchedule",
    "apply_moe_parallel",
    "build_expert_mesh",
    "check_ep_degree",
]


def check_ep_degree(model: nn.Module, dims: ParallelDims) -> None:
    """Raise ``ValueError`` naming what ``ep``/``tp`` cannot divide or combine with."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"ep={dims.ep} needs an MoE model (qwen3:debugmodel_moe, qwen3:30B-A3B, ...)")
    experts = layers[0].router.num_experts
    if experts % dims.ep:
        raise ValueError(f"ep={dims.ep} must divide the model's moe_args.num_experts={experts}")
    if dims.ep > 1 and (dims.dp_replicate > 1 or dims.cp > 1 or dims.pp > 1):
        raise ValueError("ep > 1 is supported with dp_shard and tp; not yet with dp_replicate, cp or pp")
    if dims.ep > 1 and dims.tp > 1 and dims.ep % dims.tp:
        raise ValueError(f"ep={dims.ep} must be a multiple of tp={dims.tp} (EP borrows the TP ranks first)")
    if dims.tp > 1 and not dims.ep > 1:
        inter = layers[0].experts.w1.shape[1]
        if inter % dims.tp:
            raise ValueError(f"tp={dims.tp} must divide the model's moe_inter_dim={inter}")


def build_expert_mesh(dims: ParallelDims, device: torch.device | str = "cpu") -> DeviceMesh:
    """TorchTitan's sparse mesh ``(efsdp, ep)`` over the ``dp_shard x tp`` ranks (``ep`` innermost): the
    routed experts are sharded over ``ep`` and FSDP-sharded over ``efsdp = dp_shard * tp / ep``."""
    if not dist.is_initialized():
        raise RuntimeError("build_expert_mesh needs an initialised process group (see init_distributed)")
    efsdp = dims.dp_shard * dims.cp * dims.tp // dims.ep
    return init_device_mesh(torch.device(device).type, (efsdp, dims.ep), mesh_dim_names=("efsdp", "ep"))


class PortableExpertParallel(ExpertParallel):
    """TorchTitan's ``ExpertParallel``; off CUDA, the received tokens are grouped by local expert with a
    stable sort instead of TorchTitan's Triton kernel (and without the grouped-GEMM padding)."""

    portable_order: torch.Tensor | None = None

    def _token_dispatch(self, mod, inputs, device_mesh):
        routed_input, num_tokens_per_expert = inputs
        if routed_input.is_cuda:
            self.portable_order = None
            return super()._token_dispatch(mod, inputs, device_mesh)
        ep = device_mesh.shape[0]
        local = num_tokens_per_expert.shape[0] // ep
        group = device_mesh.get_group()
        with torch.no_grad():
            received = torch.empty_like(num_tokens_per_expert)
            dist.all_to_all_single(received, num_tokens_per_expert, group=group)
            self.input_splits = num_tokens_per_expert.view(ep, local).sum(1).tolist()
            self.output_splits = received.view(ep, local).sum(1).tolist()
            # Received tokens come rank-major (from rank r: its tokens for local expert 0, 1, ...);
            # the experts want them expert-major (for expert e: from rank 0, 1, ...).
            chunk = torch.repeat_interleave(torch.arange(ep * local, device=received.device), received)
            self.portable_order = torch.argsort((chunk % local) * ep + chunk // local, stable=True)
        routed_input = all_to_all_single_autograd(routed_input, self.output_splits, self.input_splits, group)
        return routed_input[self.portable_order], received.view(ep, local).sum(0)

    def _token_combine(self, mod, routed_output, device_mesh):
        if self.portable_order is None:
            return super()._token_combine(mod, routed_output, device_mesh)
        unsorted = torch.zeros_like(routed_output).index_copy(0, self.portable_order, routed_output)
        self.portable_order = None
        return all_to_all_single_autograd(
            unsorted, self.input_splits, self.output_splits, device_mesh.get_group()
        )


def apply_moe_parallel(model: nn.Module, dims: ParallelDims, tp_mesh: DeviceMesh | None, ep_mesh) -> None:
    """TorchTitan's ``apply_moe_ep_tp`` (``etp = 1``) on the model's MoE layers, in place. Apply after
    the dense TP plan and before AC, compile and FSDP (TorchTitan's order)."""
    check_ep_degree(model, dims)
    for moe in moe_layers(model):
        if tp_mesh is not None:
            # input gathered along the sequence, output reduce-scattered back to it
            io = PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Partial(),),
                desired_output_layouts=(Shard(1),),
            )
            parallelize_module(moe, tp_mesh, io)
            plan = {"router.gate": NoParallel()}  # replicated router
            moe.tp_mesh, moe.tokens_split_over_tp = tp_mesh, ep_mesh is not None
            if ep_mesh is not None:
                plan["reorderer"] = ReordererSequenceParallel()
            if moe.shared_experts is not None:
                plan.update(
                    {
                        "shared_experts.w1": ColwiseParallel(),
                        "shared_experts.w2": RowwiseParallel(output_layouts=Partial()),
                        "shared_experts.w3": ColwiseParallel(),
                    }
                )
            parallelize_module(moe, tp_mesh, plan)
        if ep_mesh is None:
            parallelize_module(moe.experts, tp_mesh, TensorParallel())
        else:
            parallelize_module(moe.experts, ep_mesh, PortableExpertParallel())
    if dims.ep > 1:
        add_hooks(model, EPSchedule(ep_mesh))


class EPSchedule(ScheduleHooks):
    """Registered by :func:`apply_moe_parallel` under EP: before a group trains, the EP ranks compare what
    they are about to run, so a mismatch is a ``ValueError`` on every rank instead of a hang."""

    def __init__(self, ep_mesh: DeviceMesh) -> None:
        self.ep_mesh = ep_mesh

    def check(self, model, group, system) -> None:
        tree = group_tree(group) if isinstance(group, RolloutGroup) else group
        shape = [int(system == "prefixflow"), tree.n, *tree.parents, *tree.path_ends]
        mine = torch.tensor([len(shape), *shape])
        width = [torch.zeros(1, dtype=mine.dtype) for _ in range(self.ep_mesh.size())]
        dist.all_gather(width, mine[:1], group=self.ep_mesh.get_group())
        widest = max(int(w) for w in width) + 1
        padded = torch.full((widest,), -2, dtype=mine.dtype)
        padded[: len(mine)] = mine
        everyone = [torch.empty_like(padded) for _ in range(self.ep_mesh.size())]
        dist.all_gather(everyone, padded, group=self.ep_mesh.get_group())
        if any(not torch.equal(other, everyone[0]) for other in everyone):
            seen = [tuple(t[1:3].tolist()) for t in everyone]
            raise ValueError(
                "expert parallelism runs the EP ranks' MoE layers in lockstep: every EP rank must train the "
                "same system on a group (or tree) of the same shape: the same number of responses and prompt "
                f"of >1 token on all or none, the same tree nodes and paths; got (prefixflow?, paths) = {seen}"
            )
