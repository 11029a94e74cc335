"""What ``train_group`` checks before any gradient changes (one ``ValueError``/``TypeError`` naming the field)."""

from __future__ import annotations

import torch
from torch import nn

from ..group import RolloutGroup
from ..hooks import hooks_of
from ..loss import LossConfig, resolve_loss
from ..memory.budget import AUTO
from ..model.adapters import adapter_for
from ..model.apply import runtime_of
from ..model.compile import is_compiled
from ..tree.layouts import LAYOUTS
from ..tree.rollout_tree import RolloutTree

__all__ = ["SYSTEMS", "validate_call", "compute_dtype", "check_group"]

SYSTEMS = ("prefixflow", "baseline")


def check_group(
    model: nn.Module,
    group: RolloutGroup | RolloutTree,
    *,
    system: str = "prefixflow",
    layout: str = "padded",
    microbatch: int | str | None = None,
    loss: str = "pg",
    loss_config: dict | LossConfig | None = None,
) -> LossConfig:
    """Everything ``train_group`` validates, without training: raises ``ValueError``/``TypeError`` naming the
    field. Lets a caller validate several groups before the first one changes any gradient."""
    runtime_of(model)
    validate_call(model, group, system, layout, microbatch)
    losses = group.path_losses() if isinstance(group, RolloutTree) else group
    return resolve_loss(loss, loss_config, losses)


def validate_call(model: nn.Module, group, system: str, layout: str, microbatch, hooks=None) -> None:
    """Raise ``ValueError``/``TypeError`` naming the field for input ``train_group`` cannot run: the system,
    layout and microbatch, what the model's stage, adapter and hooks (``hooks``: the call's, default the
    model's) refuse, and the group's fit."""
    if not isinstance(group, (RolloutGroup, RolloutTree)):
        raise TypeError(f"group must be a prefixflow.RolloutGroup or RolloutTree, got {type(group).__name__}")
    if system not in SYSTEMS:
        raise ValueError(f"system {system!r} unknown; valid systems: {SYSTEMS}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} unknown; valid layouts: {LAYOUTS}")
    runtime = runtime_of(model)
    if microbatch == AUTO:
        if runtime.config.memory_budget_bytes is None:
            raise ValueError(
                "microbatch='auto' needs a memory budget: apply_prefixflow(model, "
                "PrefixFlowConfig(memory_budget_bytes=...)), or pass an int microbatch"
            )
        if is_compiled(model):
            raise ValueError(
                "microbatch='auto' measures memory with a dispatch mode, which compiled blocks cannot run "
                "under; pass an int microbatch with apply_compile"
            )
    elif microbatch is not None and (
        isinstance(microbatch, bool) or not isinstance(microbatch, int) or microbatch < 1
    ):
        raise ValueError(
            f"microbatch must be None (all responses), an int >= 1 or 'auto', got {microbatch!r}"
        )
    if runtime.state.state_layers and is_compiled(model):
        kinds = sorted({layer.layer_type for layer in runtime.state.state_layers})
        raise ValueError(f"compiled blocks do not run recurrent layers ({kinds}) yet; drop apply_compile")
    if runtime.stage is not None:
        runtime.stage.check(model, system, microbatch)
    if isinstance(group, RolloutTree):
        _check_recurrent_nodes(model, group)
    adapter = adapter_for(model)
    inputs = group.prompt_inputs if isinstance(group, RolloutGroup) else group.path_inputs
    if inputs is not None and not adapter.takes_inputs:
        field = "prompt_inputs" if isinstance(group, RolloutGroup) else "path_inputs"
        raise ValueError(
            f"{field} carries multimodal inputs; {type(model).__name__} ({adapter.name} adapter) takes none: "
            "drop them, or train a vision-language model (docs/multimodal.md)"
        )
    group.check_fits(adapter.vocab_size(model), adapter.max_seq_len(model), adapter.max_seq_len_field)
    group.check_representable(compute_dtype(model))
    adapter.check(model, group)
    if group.routing is not None and runtime.moe is None:
        name = "tree" if isinstance(group, RolloutTree) else "group"
        raise ValueError(f"{name}.routing replays MoE expert choices, but this model has no MoE layers")
    (hooks_of(model) if hooks is None else hooks).check(model, group, system)


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the loss is computed in: the parameters' dtype, at least fp32 (see ``token_logprobs``)."""
    return torch.promote_types(next(model.parameters()).dtype, torch.float32)


def _check_recurrent_nodes(model: nn.Module, tree: RolloutTree) -> None:
    """A recurrent layer cannot keep its end state after one token run from its parent's state yet."""
    if not runtime_of(model).state.state_layers:
        return
    short = [
        j for j in range(tree.n_nodes) if tree.node_len(j) == 1 and tree.parents[j] >= 0 and tree.children[j]
    ]
    if short:
        raise ValueError(
            f"node {short[0]} is one token long and has children: a recurrent layer cannot keep its end "
            "state after one token run from its parent's state yet; build the tree with "
            "build_tree(..., min_shared_tokens=2)"
        )
