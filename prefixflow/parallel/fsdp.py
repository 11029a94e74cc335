"""FSDP2 under the three phases: TorchTitan's sharding units, one gradient reduction per step, no residue.

``apply_fsdp`` shards like TorchTitan's ``apply_fsdp`` (``fully_shard`` on the embedding, on every block, on
``[norm, output]``, then the root; a tied embedding/LM head is one unit), with SUM reductions and no gradient
division: every rank's groups add up, so the gradients equal one process training all the groups. The units
come from the model's adapter (:meth:`~prefixflow.model.adapters.ModelAdapter.fsdp_units`): TorchTitan's names, or
for a Hugging Face model ``embed_tokens``, each decoder layer, ``[norm, lm_head]``.

PrefixFlow's schedule calls FSDP's own hooks in an order FSDP was not written for, so ``FSDPSchedule`` (a
:class:`prefixflow.hooks.ScheduleHooks`) steers it from outside the phases:

- Gradient sync is off for every backward (Phase B microbatches, Phase C, the baseline's microbatches):
  FSDP accumulates unsharded gradients. Once the group ends (or, inside :func:`accumulate_groups`, once the
  optimizer step ends), :func:`reduce_gradients` reduce-scatters every unit exactly once. That also covers
  units whose post-backward hook never fires in Phase C (the last block's prefix ``wo``/MLP, the LM head).
- Phase A stops inside the last block (``PrefixCaptured``): that unit's forward never finishes. At the end of
  Phase A it is closed (resharded, its state set idle). Phase C reaches the last block only through its
  cached K/V, never through its output (where FSDP's pre-backward hook would gather it), so Phase C gathers
  it before the prefix backward reads its weights (or an activation-checkpoint recompute runs it).
- An error anywhere in a group resets FSDP (``reset_iter_state``) and drops the unreduced gradients.
- A forward with no backward (``hooks.forward_only``: policy evaluation) resets FSDP on exit, so every unit
  is resharded (the LM head stays gathered after its forward otherwise).

:func:`fsdp_residue` lists whatever FSDP state outlives a group (tests assert it is empty), and the
reduce-scatters/all-gathers per unit are counted (:func:`collective_counts`).

This module touches a few private FSDP2 attributes (torch is pinned to 2.13.0); they are all here and in
:mod:`prefixflow.parallel.fsdp_compat` (where torch 2.11 names them differently).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

from ..hooks import ScheduleHooks, add_hooks, hooks_of
from ..model.adapters import adapter_for
from ..runtime import runtime_of
from . import fsdp_compat as compat

__all__ = [
    "FSDPConfig",
    "FSDPSchedule",
    "apply_fsdp",
    "reduce_gradients",
    "accumulate_groups",
    "gathered_for_step",
    "fsdp_residue",
    "reshard_units",
    "collective_counts",
    "reset_collective_counts",
]


@dataclass(frozen=True)
class FSDPConfig:
    """``reshard_after_forward``: free each block's gathered parameters after its forward (ZeRO-3,
    TorchTitan's default without PP); every rank must then run the same sequence of forwards and backwards.
    ``param_dtype``/``reduce_dtype``: FSDP2's mixed-precision policy (None = the parameters' dtype)."""

    reshard_after_forward: bool = True
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


class _Counter:
    def __init__(self) -> None:
        self.reduce_scatter: Counter[str] = Counter()
        self.all_gather: Counter[str] = Counter()
        self.reduce_scatter_bytes = 0


class _CountedReduceScatter(ReduceScatter):
    def __init__(self, counter: _Counter, unit: str) -> None:
        self.counter, self.unit = counter, unit

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.counter.reduce_scatter[self.unit] += 1
        self.counter.reduce_scatter_bytes += input_tensor.numel() * input_tensor.element_size()
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class _CountedAllGather(AllGather):
    def __init__(self, counter: _Counter, unit: str) -> None:
        self.counter, self.unit = counter, unit

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.counter.all_gather[self.unit] += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def _units(model: nn.Module) -> list[tuple[str, nn.Module | list[nn.Module]]]:
    """The model family's sharding units (:meth:`prefixflow.model.adapters.ModelAdapter.fsdp_units`), checked to
    cover every parameter: PrefixFlow runs the model piecewise, so a parameter left to the root would never
    be gathered."""
    units = adapter_for(model).fsdp_units(model)
    covered = {
        id(p)
        for _, unit in units
        for m in (unit if isinstance(unit, list) else [unit])
        for p in m.parameters()
    }
    left = [name for name, p in model.named_parameters() if id(p) not in covered]
    if left:
        raise ValueError(
            f"parameters {left[:3]} belong to no FSDP unit of the model's adapter (fsdp_units); PrefixFlow "
            "never runs the root's forward, so every parameter needs a unit"
        )
    return units


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    config: FSDPConfig | None = None,
    *,
    expert_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """``fully_shard`` the model over ``mesh`` (1-D: FSDP; 2-D ``(replicate, shard)``: HSDP) and register
    :class:`FSDPSchedule`. Apply after TP, EP, AC and compile (TorchTitan's order). ``expert_mesh``: under
    expert parallelism, each MoE layer's routed experts (already sharded over ``ep``) form their own unit
    over this mesh (TorchTitan's ``efsdp``), as TorchTitan's ``apply_fsdp`` does."""
    config = config or FSDPConfig()
    units = _units(model)  # raises before anything is sharded
    mp = MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype)
    counter = _Counter()
    if expert_mesh is not None:
        from ..moe import moe_layers

        for moe in moe_layers(model):
            fully_shard(
                moe.experts,
                mesh=expert_mesh,
                mp_policy=mp,
                reshard_after_forward=config.reshard_after_forward,
            )
    for name, unit in units:
        # TorchTitan keeps the LM head gathered after forward: backward needs it right away
        reshard = config.reshard_after_forward and not isinstance(unit, list)
        fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        first = unit[0] if isinstance(unit, list) else unit
        first.set_custom_reduce_scatter(_CountedReduceScatter(counter, name))
        first.set_custom_all_gather(_CountedAllGather(counter, name))
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=config.reshard_after_forward)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # SUM: each rank's groups add up
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM; same math on NCCL
            # every rank reduces every parameter, also one its groups left without a gradient. torch 2.11 has no
            # such switch: there every parameter must get a gradient on every rank (fsdp_compat, docs/gpu.md)
            if hasattr(module, "set_reduce_scatter_unused_params"):
                module.set_reduce_scatter_unused_params(True)
    # PrefixFlow runs the model piecewise (embedding, blocks, head), never through the root's forward: make
    # the root the root now, before a child's forward could claim it.
    _root_state(model)._lazy_init()
    runtime_of(model, create=True).fsdp = counter
    add_hooks(model, FSDPSchedule(model))
    return model


def _root_state(model: nn.Module):
    if not isinstance(model, FSDPModule):
        raise ValueError("the model is not sharded with FSDP2 (see prefixflow.parallel.apply_fsdp)")
    return model._get_fsdp_state()


def _states(model: nn.Module) -> list:
    return compat.all_states(_root_state(model))


def _groups(model: nn.Module):
    for state in _states(model):
        yield from compat.param_groups(state)


def collective_counts(model: nn.Module) -> dict[str, dict[str, int]]:
    """Reduce-scatters and all-gathers per FSDP unit since the last :func:`reset_collective_counts`."""
    counter: _Counter = runtime_of(model, create=True).fsdp
    return {"reduce_scatter": dict(counter.reduce_scatter), "all_gather": dict(counter.all_gather)}


def reset_collective_counts(model: nn.Module) -> None:
    counter: _Counter = runtime_of(model, create=True).fsdp
    counter.reduce_scatter.clear()
    counter.all_gather.clear()
    counter.reduce_scatter_bytes = 0


def n_units(model: nn.Module) -> int:
    """FSDP units that hold parameters (each reduces its gradients in one reduce-scatter)."""
    return sum(1 for g in _groups(model) if g.fsdp_params)


def _set_sync(model: nn.Module, sync: bool) -> None:
    for group in _groups(model):
        group.reduce_grads = sync
        group.all_reduce_grads = sync


def reduce_gradients(model: nn.Module) -> None:
    """Reduce-scatter (and under HSDP all-reduce) every unit's accumulated gradients into the sharded
    ``param.grad``, once, in reverse forward order on every rank; leaves every unit idle and (unless
    parameters are held gathered for the step) resharded."""
    root = _root_state(model)
    states = _states(model)
    for state in reversed(states):
        for group in reversed(compat.param_groups(state)):
            group.reduce_grads = group.all_reduce_grads = True
            try:
                group.post_backward()
            finally:
                group.reduce_grads = group.all_reduce_grads = False
    for state in states:
        for group in compat.param_groups(state):
            group.finalize_backward()
            group._training_state = TrainingState.IDLE
        state._training_state = TrainingState.IDLE
    compat.wait_reduce_scatters(root._comm_ctx, root._device_handle.current_stream())
    root._comm_ctx.post_forward_order.clear()


def discard(model: nn.Module) -> None:
    """After an error: reset FSDP's per-iteration state, reshard, and drop gradients not yet reduced."""
    compat.reset_iter_state(model, _root_state(model))  # raises unless the model is sharded
    for group in _groups(model):
        for param in group.fsdp_params:
            param.unsharded_accumulated_grad = None
            if hasattr(param, "_unsharded_param"):
                param._unsharded_param.grad = None


def _close_interrupted_forwards(model: nn.Module) -> list:
    """Finish the FSDP forward state of units whose forward an exception left (Phase A's early stop):
    reshard them (as their post-forward would have) and mark them idle. Returns their states."""
    interrupted = []
    ctx = _root_state(model)._state_ctx
    for state in _states(model):
        groups = compat.param_groups(state)
        if state._training_state != TrainingState.FORWARD and all(
            g._training_state != TrainingState.FORWARD for g in groups
        ):
            continue
        for group in groups:
            group._training_state = TrainingState.FORWARD  # reshard() honours reshard_after_forward here
            group.reshard()
            group._training_state = TrainingState.IDLE
        state._modules_to_run_forward.clear()
        state._training_state = TrainingState.IDLE
        interrupted.append(state)
    ctx.iter_forward_root = None
    return interrupted


class FSDPSchedule(ScheduleHooks):
    """Registered by :func:`apply_fsdp`: FSDP's gradient sync and state across the three phases."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.defer_reduction = False  # True inside accumulate_groups / gathered_for_step
        self._interrupted: list = []

    @contextlib.contextmanager
    def group(self, model, group, system) -> Iterator[None]:
        _set_sync(model, False)
        self._interrupted = []
        try:
            yield
        except BaseException:
            discard(model)
            raise
        finally:
            self._interrupted = []
        compat.end_backward(_root_state(model))
        if not self.defer_reduction:
            reduce_gradients(model)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield
        if name == "A":
            self._interrupted = _close_interrupted_forwards(self.model)

    @contextlib.contextmanager
    def prefix_backward(self) -> Iterator[None]:
        # A prefix backward's gradient enters every block through its cached K/V. For the other blocks it
        # also comes through the block's output, whose FSDP pre-backward hook gathers the weights; the last
        # block's output may get none (its forward may have been cut short; a tree node may score no
        # token), so gather it here, before each prefix backward (a tree runs one per node, and the one
        # before resharded it).
        last = adapter_for(self.model).blocks(self.model)[-1]._get_fsdp_state()
        for state in {id(s): s for s in [*self._interrupted, last]}.values():
            for group in compat.param_groups(state):
                group.unshard()
                group.wait_for_unshard()
        yield

    @contextlib.contextmanager
    def forward_only(self) -> Iterator[None]:
        # No backward follows (policy evaluation): nothing would reshard the units kept gathered after their
        # forward (the LM head) or clear the forward's bookkeeping, and the module would keep its unsharded
        # parameters registered (an optimizer built then would hold the wrong tensors). FSDP's own reset.
        try:
            yield
        finally:
            compat.reset_iter_state(self.model, _root_state(self.model))


def _schedule(model: nn.Module) -> FSDPSchedule:
    for hook in hooks_of(model).hooks:
        if isinstance(hook, FSDPSchedule):
            return hook
    raise ValueError("the model is not sharded with FSDP2 (see prefixflow.parallel.apply_fsdp)")


@contextlib.contextmanager
def accumulate_groups(model: nn.Module) -> Iterator[None]:
    """Train several groups into one optimizer step: gradients are reduced once, when the block exits
    (every rank must train the same sequence of groups inside it)."""
    hook = _schedule(model)
    if hook.defer_reduction:
        yield
        return
    hook.defer_reduction = True
    try:
        yield
    except BaseException:
        hook.defer_reduction = False
        discard(model)
        raise
    hook.defer_reduction = False
    reduce_gradients(model)


@contextlib.contextmanager
def gathered_for_step(model: nn.Module) -> Iterator[None]:
    """Hold every unit's parameters gathered for one optimizer step: one all-gather per unit on entry and one
    reduce-scatter per unit on exit, and no collective in between. Ranks may then train different numbers
    of groups, of microbatches, or parts of a split group (DP placement)."""
    saved = [(g, g.post_forward_mesh_info, g.reshard_after_backward) for g in _groups(model)]
    _set_sync(model, False)  # any backward inside (not only train_group's) accumulates until the exit
    for group, _, _ in saved:
        group.post_forward_mesh_info = None  # no reshard after forward
        group.reshard_after_backward = False
        group.unshard()
        group.wait_for_unshard()
    try:
        with accumulate_groups(model):
            yield
    finally:
        for group, mesh_info, after_backward in saved:
            group.post_forward_mesh_info = mesh_info
            group.reshard_after_backward = after_backward
            group._training_state = TrainingState.IDLE
            group.reshard()


def reshard_units(model: nn.Module) -> None:
    """Reshard every unit that a forward outside PrefixFlow's schedule left gathered (an idle unit kept gathered
    after its forward: torch 2.11 still marks it in FORWARD, where ``FSDPModule.reshard`` does nothing), so the
    module holds its sharded parameters again. Collective-free."""
    for group in _groups(model):
        if group.fsdp_params and not group.is_sharded:
            group._training_state = TrainingState.IDLE
            group.reshard()


def fsdp_residue(model: nn.Module) -> list[str]:
    """What FSDP state outlives a group: units not idle or not resharded, pending collectives, forward or
    backward bookkeeping, unreduced gradients. Empty when clean."""
    out = []
    root = _root_state(model)
    ctx, comm = root._state_ctx, root._comm_ctx
    if ctx.iter_forward_root is not None:
        out.append("iter_forward_root is set")
    if ctx.post_backward_final_callback_queued:
        out.append("post-backward final callback still queued")
    if comm.post_forward_order or compat.reduce_scatter_states(comm) or comm.all_gather_state is not None:
        out.append("communication bookkeeping not cleared")
    for state in _states(model):
        if state._training_state != TrainingState.IDLE or state._modules_to_run_forward:
            out.append(f"state of {state._modules[0].__class__.__name__} is {state._training_state.name}")
        for group in compat.param_groups(state):
            name = group._module_fqn or "?"
            if group._training_state != TrainingState.IDLE:
                out.append(f"{name}: {group._training_state.name}")
            if group.fsdp_params and not group.is_sharded:
                out.append(f"{name}: parameters not resharded")
            if group._all_gather_result is not None or group._post_forward_indices:
                out.append(f"{name}: pending all-gather or post-forward indices")
            for param in group.fsdp_params:
                unsharded = getattr(param, "_unsharded_param", None)
                if param.unsharded_accumulated_grad is not None or (
                    unsharded is not None and unsharded.grad is not None
                ):
                    out.append(f"{param._param_fqn}: unreduced gradient")
    return out
