"""FSDP2 internals where torch 2.11 (the lent GPU machine's, docs/gpu.md) differs from the pinned 2.13.

Each helper reads the 2.13 name where it exists and does the same with 2.11's otherwise; prefixflow.parallel.fsdp
goes through these only. 2.11 keeps one parameter group per state, one pending reduce-scatter, lists a
multi-module state once per module, and has no ``FSDPModule.reset_iter_state``. It also lacks
``set_reduce_scatter_unused_params``: there every parameter must get a gradient on every rank (dense models
do; an MoE expert no token reaches on a rank does not).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState


def param_groups(state) -> list:
    """An FSDP state's parameter groups: a list in torch 2.13, one group or None in torch 2.11."""
    if hasattr(state, "_fsdp_param_groups"):
        return state._fsdp_param_groups
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def all_states(root) -> list:
    """The root's states, each once (2.11 lists a ``fully_shard([norm, output])`` state once per module)."""
    return list(dict.fromkeys(root._state_ctx.all_states))


def reduce_scatter_states(comm) -> list:
    """Reduce-scatters still pending: a list in torch 2.13, one state or None in torch 2.11."""
    if hasattr(comm, "reduce_scatter_states"):
        return list(comm.reduce_scatter_states)
    state = getattr(comm, "reduce_scatter_state", None)
    return [] if state is None else [state]


def wait_reduce_scatters(comm, stream) -> None:
    """Wait for the pending reduce-scatters and forget them."""
    for rs_state in reduce_scatter_states(comm):
        if rs_state.event is not None:
            stream.wait_event(rs_state.event)
    if hasattr(comm, "reduce_scatter_states"):
        comm.reduce_scatter_states.clear()
    else:
        comm.reduce_scatter_state = None


def reset_iter_state(model: nn.Module, root) -> None:
    """``FSDPModule.reset_iter_state`` (2.13); on 2.11 its steps: wait for in-flight collectives, reshard every
    group, clear the per-iteration trackers."""
    if hasattr(model, "reset_iter_state"):
        model.reset_iter_state()
        return
    stream, comm = root._device_handle.current_stream(), root._comm_ctx
    if comm.all_gather_state is not None:
        if comm.all_gather_state.event is not None:
            stream.wait_event(comm.all_gather_state.event)
        comm.all_gather_state = None
    wait_reduce_scatters(comm, stream)
    comm.post_forward_order.clear()
    for state in all_states(root):
        state._modules_to_run_forward.clear()
        state._training_state = TrainingState.IDLE
        for group in param_groups(state):
            _reset_group(group, stream)
    root._state_ctx.iter_forward_root = None
    root._state_ctx.post_backward_final_callback_queued = False


def _reset_group(group, stream) -> None:
    if group._all_gather_result is not None:
        if group._all_gather_result.all_gather_event is not None:
            stream.wait_event(group._all_gather_result.all_gather_event)
        work = group._all_gather_result.all_gather_work
        if isinstance(work, torch.distributed.distributed_c10d.Work):
            work.wait()
        group._all_gather_result = None
    if group._post_reduce_event is not None:
        stream.wait_event(group._post_reduce_event)
        group._post_reduce_event = None
    if group._all_reduce_state is not None and group._all_reduce_state.event is not None:
        stream.wait_event(group._all_reduce_state.event)
    group._all_reduce_state = None
    if group._reshard_after_forward_event is not None:
        group._wait_all_gather_streams_on_event(group._reshard_after_forward_event)
        group._reshard_after_forward_event = None
    group._partial_reduce_output = None
    group._post_forward_indices.clear()
    group._training_state = TrainingState.IDLE
    group._to_sharded()


def end_backward(root) -> None:
    """After a group's backward: no forward is in flight. torch 2.13's root post-backward callback clears
    ``iter_forward_root``; 2.11's does not, and a unit whose forward activation checkpointing recomputed in the
    backward stays the "forward root", so the next forward would skip the root's pre-forward."""
    root._state_ctx.iter_forward_root = None
