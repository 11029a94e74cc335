"""Tensor parallelism: TorchTitan's own plans for Llama3 and Qwen3, on sequences of any length.

TorchTitan's plans (``llama3 apply_tp``, ``qwen3 apply_non_moe_tp``) shard attention heads and the FFN
(colwise / rowwise) and run the norms sequence-parallel: between blocks the activations are split along the
sequence, which must then divide by the TP degree. PrefixFlow's sequences (a prefix of ``|P|-1`` tokens,
suffix microbatches) have any length, so ``apply_tp`` adds hooks around TorchTitan's modules, never inside
PrefixFlow's SDPA wrappers:

- the embedding pads the tokens at the end to a multiple of ``tp``;
- every block gets explicit positions of the real length (an activation-checkpoint recompute replays them),
  and every attention module drops the pad rows before ``wq/wk/wv`` and puts zero rows back before ``wo``.
  Attention therefore only ever sees real tokens, and every other op works per token, so pads never reach a
  real token and get no gradient;
- Qwen3's plan hands SDPA DTensors; the SDPA boundary takes their local shards, so PrefixFlow's wrappers,
  unchanged, run on plain tensors and each TP rank caches its local K/V head shard;
- the final norm's sequence-sharded output is gathered (pads dropped) and the LM head takes that replicated
  input and returns replicated logits (TorchTitan's plan without ``loss_parallel``). The loss
  (log_softmax + gather, only at the loss positions) then runs unchanged and identically on every TP rank,
  and its backward is exact. ``loss_parallel`` would save the logits' all-gather (``T x V``, loss positions
  only), at the price of a second loss implementation.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.weak import WeakTensorKeyDictionary

from ..attention.modes import PrefixAwareAttention
from ..model.models import hidden_dim_of, model_args
from ..runtime import runtime_of

__all__ = ["apply_tp", "model_family", "check_tp_degree"]


def model_family(model: nn.Module) -> str:
    """``"llama3"`` or ``"qwen3"`` (from ``build_model``'s name, else from the class)."""
    name = runtime_of(model, create=True).name
    if ":" in name:
        return name.split(":")[0]
    return {"Transformer": "llama3", "Qwen3Model": "qwen3"}.get(type(model).__name__, type(model).__name__)


def check_tp_degree(model: nn.Module, tp: int) -> None:
    """Raise ``ValueError`` naming the model field that ``tp`` does not divide."""
    args = model_args(model)
    sizes = {
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads or args.n_heads,
        "hidden_dim": hidden_dim_of(args),
        "vocab_size": args.vocab_size,
        "dim": args.dim,
    }
    for field, size in sizes.items():
        if size % tp:
            raise ValueError(
                f"tp={tp} must divide the model's {field}={size} (TorchTitan shards it over the TP ranks)"
            )


class _RealLength:
    """The un-padded sequence length of the forward in flight (set by the embedding hook)."""

    def __init__(self) -> None:
        self.value: int | None = None


def _pad_seq(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x.shape[1]) % multiple
    if not pad:
        return x
    widths = [0, 0] * (x.dim() - 2) + [0, pad]  # F.pad lists the last dim first; dim 1 is the sequence
    return F.pad(x, widths)


def _local(x: Any) -> Any:
    return x.to_local() if isinstance(x, DTensor) else x


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Apply TorchTitan's TP plan for the model's family over ``tp_mesh`` (in place), plus the hooks above.

    Call it before ``apply_ac``/``apply_compile``/FSDP (TorchTitan's order) and after ``apply_prefixflow``.
    Gradients are DTensors (``.full_tensor()`` gathers one).
    """
    tp = tp_mesh.size()
    check_tp_degree(model, tp)
    family = model_family(model)
    tok, head = model.tok_embeddings, model.output  # None on pipeline stages that do not hold them
    tied = tok is not None and head is not None and head.weight is tok.weight
    if family == "llama3":
        from torchtitan.models.llama3.infra.parallelize import apply_tp as titan_apply_tp

        titan_apply_tp(model, tp_mesh, loss_parallel=False, enable_float8_tensorwise_tp=False)
    elif family == "qwen3":
        from torchtitan.models.qwen3.infra.parallelize import apply_non_moe_tp

        apply_non_moe_tp(
            model,
            tp_mesh,
            loss_parallel=False,
            enable_float8_tensorwise_tp=False,
            enable_async_tp=False,
            cp_enabled=False,
        )
    else:
        raise ValueError(f"tensor parallelism has TorchTitan plans for llama3 and qwen3, not {family!r}")
    if tied:
        # parallelize_module distributes the embedding and the LM head separately, which unties Qwen3's shared
        # weight; both plans shard it the same way (Shard(0) over the vocabulary), so tie it again.
        model.output.weight = model.tok_embeddings.weight
    _install_length_hooks(model, tp_mesh, tp)
    runtime_of(model, create=True).tp = tp
    return model


def _install_length_hooks(model: nn.Module, tp_mesh: DeviceMesh, tp: int) -> None:
    real = _RealLength()

    def pad_tokens(module, args):
        tokens = args[0]
        real.value = tokens.shape[1]
        return (_pad_seq(tokens, tp), *args[1:])

    # Positions of the real length for each block whose caller gave none. Keyed by the block's input, so an
    # activation-checkpoint recompute (which replays the same input long after ``real`` moved on) gets the
    # positions its forward got.
    given: WeakTensorKeyDictionary = WeakTensorKeyDictionary()

    def explicit_positions(module, args, kwargs):
        # TransformerBlock.forward(x, rope, attention_masks, positions)
        x = args[0]
        in_args = len(args) > 3
        given_positions = args[3] if in_args else kwargs.get("positions")
        if given_positions is not None:
            real.value = given_positions.shape[-1]  # a pipeline stage without the embedding learns it here
            return None
        positions = given.get(x)
        if positions is None:
            positions = torch.arange(real.value, device=_local(x).device).unsqueeze(0)
            given[x] = positions
        if in_args:
            return (*args[:3], positions, *args[4:]), kwargs
        return args, {**kwargs, "positions": positions}

    def drop_pad_rows(module, args):
        # Attention.forward(x, rope, attention_masks, positions): x is TP's replicated [b, L_padded, dim]
        x, rope, masks, positions = args[:4]
        if isinstance(rope, DTensor) and not isinstance(positions, DTensor):
            # Qwen3's plan makes the RoPE cache a replicated DTensor; index it with a DTensor too
            positions = DTensor.from_local(positions, rope.device_mesh, [Replicate()], run_check=False)
        return (x[:, : positions.shape[-1]], rope, masks, positions, *args[4:])

    def local_heads(module, args, kwargs):
        return tuple(_local(t) for t in args), kwargs

    def restore_pad_rows(module, args):
        return (_pad_seq(_local(args[0]), tp), *args[1:])

    def gather_hidden(module, args, out):
        if isinstance(out, DTensor):
            out = out.full_tensor()
        return out[:, : real.value]

    def replicated_head_input(module, args):
        x = args[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False)
        return (x, *args[1:])

    if model.tok_embeddings is not None:  # pipeline stages hold a part of the model
        model.tok_embeddings.register_forward_pre_hook(pad_tokens, prepend=True)
    for block in model.layers.values():
        block.register_forward_pre_hook(explicit_positions, with_kwargs=True)
        attention = next(m for m in block.modules() if hasattr(m, "inner_attention"))
        attention.register_forward_pre_hook(drop_pad_rows)  # after TP's input hook (x is replicated)
        if not isinstance(attention.inner_attention, PrefixAwareAttention):
            raise ValueError("apply_tp needs PrefixFlow's SDPA wrappers: call apply_prefixflow(model) first")
        attention.inner_attention.register_forward_pre_hook(local_heads, with_kwargs=True)
        attention.wo.register_forward_pre_hook(restore_pad_rows, prepend=True)  # before TP's input hook
    if model.norm is not None:
        model.norm.register_forward_hook(gather_hidden)
    if model.output is not None:
        model.output.register_forward_pre_hook(replicated_head_input, prepend=True)
