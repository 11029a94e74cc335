"""``PrefixFlowGRPOTrainer`` under PrefixFlow's FSDP2 (``prefixflow_parallel={"dp_shard": N}``, or a model the
caller sharded with :func:`prefixflow.parallel.parallelize`).

accelerate 1.15 turns FSDP on only from its GPU states; on MULTI_CPU its FSDP plugin is ignored and it wraps the
model in DDP, which fails over DTensor parameters (and would reduce a second time). So the sharding is
PrefixFlow's own: the HF adapter's units (``embed_tokens``, each decoder layer, final norm + ``lm_head``; a tied
embedding joins the last), :class:`~prefixflow.parallel.fsdp.FSDPSchedule` steering FSDP around the phases.

- accelerate prepares the sharded model for autocast only (:func:`keep_out_of_ddp`): no DDP, no device move.
- Each micro-batch (:func:`gathered`): every unit is gathered once, each rank trains its own prompts' groups (the
  ranks may train different numbers of groups), and every unit reduce-scatters once at the end. FSDP sums where
  DDP averages TRL's gradients, so the trainer divides the objective by the number of processes. One non-finite
  verdict per micro-batch (a collective), around it all.
- TRL's generation, log-prob forwards and metrics run the sharded model as FSDP2 runs any model (``generate``
  sets ``synced_gpus`` for an FSDP-managed model, so every rank forwards until the last one finishes).
- ``save_model`` (and ``save_only_model`` checkpoints) gathers the full weights onto rank 0, which writes them
  (:func:`full_state_dict`); a checkpoint with the sharded optimizer state is refused.
- ``verify_first_step`` compares TRL's ``compute_loss -> backward`` on the sharded model with PrefixFlow's
  update, both reduced the same way; the verdict is collective (:func:`worst_rel_diff`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule

from ...parallel import ParallelDims, parallel_state
from ...parallel import fsdp as pf_fsdp
from ...schedule.grad_guard import keep_grads_on_failure

__all__ = ["check", "keep_out_of_ddp", "reshard", "gathered", "full_state_dict", "worst_rel_diff"]


def check(
    inner: nn.Module, dims: ParallelDims | None, args, *, world: int, peft: bool, foreign: bool
) -> bool:
    """Whether the model is (or ``dims`` will make it) sharded by PrefixFlow's FSDP2. Raises ``ValueError``, before
    anything is sharded, for a layout or option (``args``: the ``GRPOConfig``) the trainer cannot run that way.
    ``foreign``: sharded at load time by transformers."""
    state = parallel_state(inner)
    if dims is None and state is None:
        if isinstance(inner, FSDPModule) or foreign:
            raise ValueError(
                "the model is sharded with FSDP2 outside PrefixFlow; shard it with "
                "prefixflow_parallel={'dp_shard': N} (or prefixflow.parallel.parallelize) instead"
            )
        return False
    if dims is not None and state is not None:
        raise ValueError("prefixflow_parallel: the model is already parallelized; drop the argument")
    refusals = {
        "peft_config / a PEFT model (LoRA layers added around FSDP2's sharded weights are not sharded; train LoRA "
        "with DDP)": peft,
        "checkpoints with optimizer state (it is sharded and the Trainer saves rank 0's part; pass "
        "save_only_model=True or save_strategy='no')": args.save_strategy != "no"
        and not args.save_only_model,
    }
    bad = [name for name, refused in refusals.items() if refused]
    if bad:
        raise ValueError(f"PrefixFlowGRPOTrainer with FSDP2 does not support: {'; '.join(bad)}")
    dims = dims if dims is not None else state.dims
    if world < 2 or dims.dp_shard != world or dims.world_size != world:
        layout = {k: v for k, v in dims.as_dict().items() if v > 1}
        raise ValueError(
            f"prefixflow_parallel={layout}: PrefixFlowGRPOTrainer shards over every process, dp_shard={world} "
            "and nothing else; on one process, or without sharding, leave it unset (DDP through accelerate)"
        )
    return True


def keep_out_of_ddp(accelerator, inner: nn.Module) -> None:
    """accelerate prepares ``inner`` for autocast only: FSDP2 owns its placement and gradient reduction."""
    prepare = accelerator.prepare_model

    def prepare_model(model, device_placement=None, evaluation_mode=False):
        if model is inner:
            return prepare(model, device_placement=False, evaluation_mode=True)
        return prepare(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    accelerator.prepare_model = prepare_model


def reshard(inner: nn.Module) -> None:
    """Reshard every FSDP2 unit. TRL's forwards leave the LM head's unit gathered (it is kept gathered after its
    forward), with its unsharded tensors registered as the module's parameters; afterwards ``named_parameters``
    are the sharded ones again."""
    pf_fsdp.reshard_units(inner)


@contextlib.contextmanager
def gathered(inner: nn.Module) -> Iterator[None]:
    """One micro-batch: every unit gathered on entry and reduce-scattered on exit
    (:func:`~prefixflow.parallel.fsdp.gathered_for_step`), inside one collective non-finite verdict (each
    group's own would be a collective, and the ranks may train different numbers of groups)."""
    reshard(inner)  # the guard must see the sharded parameters
    with keep_grads_on_failure(inner), pf_fsdp.gathered_for_step(inner):
        yield


def full_state_dict(inner: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights, gathered on every rank's call (a collective) onto the CPU of rank 0 (the other
    ranks get an empty dict): what ``save_pretrained`` writes."""
    reshard(inner)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(inner, options=options)


def worst_rel_diff(params, got, want, *, collective: bool = False) -> tuple[float, str | None]:
    """Max over tensors of max|got - want| / max|want|. ``collective``: the gradients are sharded (FSDP2): each
    rank compares its shards and the maxima are all-reduced, so every rank reaches the same verdict."""
    names, rows = [], []
    for (name, _), g, w in zip(params, got, want, strict=True):
        if w is None and g is None:
            continue
        if w is None or g is None:
            return float("inf"), name
        g, w = (t.to_local() if hasattr(t, "to_local") else t for t in (g, w))
        if w.numel() == 0:
            rows.append(torch.zeros(2, dtype=torch.float64, device=w.device))
        else:
            rows.append(torch.stack([(g.double() - w.double()).abs().max(), w.double().abs().max()]))
        names.append(name)
    if not rows:
        return 0.0, None
    table = torch.stack(rows)
    if collective:
        dist.all_reduce(table, op=dist.ReduceOp.MAX)
    diffs = table[:, 0] / torch.where(table[:, 1] > 0, table[:, 1], torch.ones_like(table[:, 1]))
    i = int(diffs.argmax())
    return float(diffs[i]), names[i]
