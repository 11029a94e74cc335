"""TorchTitan model registry: ``"family:flavor"`` + overrides -> a plain, initialised ``nn.Module``."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..runtime import runtime_of

__all__ = [
    "build_model",
    "check_model",
    "resolve_model_args",
    "register_build_step",
    "model_args",
    "list_models",
    "rope_buffer",
    "hidden_dim_of",
    "head_dim_of",
]
# Run on every model build_model returns, in registration order (register_build_step).
_BUILD_STEPS: list[Callable[[nn.Module], None]] = []
# ModelArgs sizes that must be positive (a zero or negative one fails deep in torch with no field named)
_SIZES = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "vocab_size",
    "max_seq_len",
    "head_dim",
    "hidden_dim",
    "multiple_of",
    "moe_inter_dim",
)
# ModelArgs reals that must be finite and positive
_POSITIVE_REALS = ("rope_theta", "norm_eps", "ffn_dim_multiplier")


def _families() -> dict[str, tuple[dict, type]]:
    # Imported lazily: importing torchtitan costs seconds.
    from torchtitan.models.llama3 import Transformer, llama3_args
    from torchtitan.models.qwen3 import Qwen3Model, qwen3_args

    # Only SDPA flavours: flex/varlen attention have no CPU backward and bypass our SDPA boundary.
    # MoE flavours (debugmodel_moe, 30B-A3B, ...) get prefixflow.moe.apply_moe from its build step.
    sdpa_llama3 = {k: v for k, v in llama3_args.items() if getattr(v, "attn_type", "sdpa") == "sdpa"}
    sdpa_qwen3 = {k: v for k, v in qwen3_args.items() if getattr(v, "attn_type", "sdpa") == "sdpa"}
    return {"llama3": (sdpa_llama3, Transformer), "qwen3": (sdpa_qwen3, Qwen3Model)}


def list_models() -> list[str]:
    """All valid ``family:flavor`` names."""
    return [f"{fam}:{flavor}" for fam, (flavors, _) in _families().items() for flavor in flavors]


def _resolve_args(name: str, overrides: dict[str, Any] | None):
    if not isinstance(name, str) or name.count(":") != 1:
        raise ValueError(f"model name {name!r} must look like 'family:flavor'; valid names: {list_models()}")
    family, flavor = name.split(":")
    families = _families()
    if family not in families:
        raise ValueError(f"unknown model family {family!r} in {name!r}; valid families: {sorted(families)}")
    flavors, cls = families[family]
    if flavor not in flavors:
        raise ValueError(f"unknown {family} flavor {flavor!r}; valid flavors: {sorted(flavors)}")
    args = copy.deepcopy(flavors[flavor])
    overrides = dict(overrides or {})
    valid = _fields(args)
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(f"unknown override field(s) {unknown} for {family}; valid fields: {sorted(valid)}")
    for key, value in overrides.items():
        current = valid[key]
        if current is not None and (
            (
                not isinstance(value, type(current))
                and not (isinstance(current, float) and isinstance(value, int))
            )
            or isinstance(value, bool) != isinstance(current, bool)
        ):
            raise ValueError(
                f"override {key}={value!r} has type {type(value).__name__}; "
                f"{family} expects {type(current).__name__}"
            )
    nested = {k: v for k, v in overrides.items() if "." in k}
    args = dataclasses.replace(args, **{k: v for k, v in overrides.items() if "." not in k})
    for key, value in nested.items():
        outer, inner = key.split(".")
        setattr(args, outer, dataclasses.replace(getattr(args, outer), **{inner: value}))
    for key in _SIZES:
        value = getattr(args, key, None)
        if isinstance(value, int) and value < 1:
            raise ValueError(f"{family} {key}={value} must be >= 1")
    default = flavors[flavor]
    for key in _POSITIVE_REALS:  # a zero, negative or non-finite one gives NaN deep inside the first step
        value = getattr(args, key, None)
        if isinstance(value, int | float) and not (math.isfinite(value) and value > 0):
            raise ValueError(
                f"{family} {key}={value} must be a finite number > 0 (the flavor's: {getattr(default, key)})"
            )
    if args.n_heads % (args.n_kv_heads or args.n_heads):
        raise ValueError(f"n_heads={args.n_heads} must be a multiple of n_kv_heads={args.n_kv_heads}")
    if family == "llama3" and args.dim % args.n_heads:
        raise ValueError(f"llama3 needs dim ({args.dim}) divisible by n_heads ({args.n_heads})")
    return args, cls


def _fields(args) -> dict[str, Any]:
    """Overridable fields and their current values; nested dataclasses (Qwen3's ``moe_args``) as
    ``outer.inner`` (e.g. ``moe_args.num_experts``)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(args):
        if f.name.startswith("_"):
            continue
        value = getattr(args, f.name)
        if dataclasses.is_dataclass(value):
            for g in dataclasses.fields(value):
                if not g.name.startswith("_"):
                    out[f"{f.name}.{g.name}"] = getattr(value, g.name)
        else:
            out[f.name] = value
    return out


def check_model(name: str, overrides: dict[str, Any] | None = None) -> None:
    """Raise ValueError naming the field if ``name`` + ``overrides`` cannot build a model (no model built)."""
    _resolve_args(name, overrides)


def resolve_model_args(name: str, overrides: dict[str, Any] | None = None):
    """The TorchTitan ModelArgs ``name`` + ``overrides`` would build (a copy; checked as :func:`check_model`
    checks them; nothing built)."""
    return _resolve_args(name, overrides)[0]


def count_parameters(name: str, overrides: dict[str, Any] | None = None) -> int:
    """Parameters of ``name`` + ``overrides``, counted on the meta device (no memory, no init)."""
    args, cls = _resolve_args(name, overrides)
    with torch.device("meta"):
        return sum(p.numel() for p in cls(args).parameters())


def register_build_step(step: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
    """Run ``step(model)`` on every model :func:`build_model` builds, after its weights are initialised
    (idempotent per step; returns it). A step changes the models it concerns in place and leaves the others
    alone: :mod:`prefixflow.moe` registers one that applies ``apply_moe`` to MoE flavours, so this module never
    imports it."""
    if not callable(step):
        raise TypeError(f"a build step must be callable (model -> None), got {type(step).__name__}")
    if step not in _BUILD_STEPS:
        _BUILD_STEPS.append(step)
    return step


def build_model(
    name: str,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """Build a TorchTitan model by ``family:flavor`` with deterministic random weights.

    The model is created on the meta device, materialised on ``device`` and initialised by TorchTitan's own
    ``init_weights`` under ``torch.manual_seed(seed)``; ``device="meta"`` keeps it there, a shape without
    values and so without init (what an estimate materialises as fake tensors). Only parameters are cast to ``dtype``: RoPE buffers keep
    their dtype (``Module.to(dtype)`` would turn Llama3's complex ``freqs_cis`` into a real tensor).
    Then every registered build step runs (:func:`register_build_step`): MoE flavours come with
    :func:`prefixflow.moe.apply_moe` applied; their ``overrides`` reach the MoE arguments as
    ``moe_args.FIELD`` (e.g. ``{"moe_args.num_experts": 4, "moe_args.top_k": 2}``).
    ``model(tokens[B, L]) -> logits[B, L, V]``.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    args, cls = _resolve_args(name, overrides)
    device = torch.device(device)
    with torch.device("meta"):
        model = cls(args)
    if device.type != "meta":  # a meta model has no values to initialise
        model.to_empty(device=device)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            model.init_weights(buffer_device=device)
    for param in model.parameters():
        param.data = param.data.to(dtype)
    if dtype == torch.float64 and name.startswith("llama3:"):
        _use_exact_rope(model)
    for step in _BUILD_STEPS:
        step(model)
    runtime_of(model, create=True).name = name
    return model


def model_args(model: nn.Module):
    """The TorchTitan ModelArgs dataclass the model was built from."""
    args = getattr(model, "model_args", None)
    if args is None:
        raise TypeError(f"{type(model).__name__} is not a TorchTitan model (no .model_args)")
    return args


def head_dim_of(args) -> int:
    return getattr(args, "head_dim", None) or args.dim // args.n_heads


def hidden_dim_of(args) -> int:
    """FFN hidden size, computed the way each TorchTitan family does."""
    if hasattr(args, "hidden_dim"):
        return args.hidden_dim
    hidden = int(2 * 4 * args.dim / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    return args.multiple_of * ((hidden + args.multiple_of - 1) // args.multiple_of)


def rope_buffer(model: nn.Module) -> torch.Tensor:
    """The RoPE table each block takes as its second argument (Llama3 ``freqs_cis``, Qwen3 ``rope_cache``)."""
    for name in ("freqs_cis", "rope_cache"):
        if hasattr(model, name):
            return getattr(model, name)
    raise TypeError(f"{type(model).__name__} has no RoPE buffer (freqs_cis / rope_cache)")


def _rotary_emb_exact(xq, xk, freqs_cis, positions=None):
    """TorchTitan's llama3 ``apply_rotary_emb``, computed in ``promote_types(dtype, float32)`` instead of fp32:
    fp64 inputs stay fp64; for fp32/bf16/fp16 it is ``.float()``, the original arithmetic."""
    from torchtitan.models.llama3.model.model import reshape_for_broadcast

    compute = torch.promote_types(xq.dtype, torch.float32)
    xq_ = torch.view_as_complex(xq.to(compute).reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.to(compute).reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_, positions)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


@functools.cache
def _exact_rope_attention_forward():
    """TorchTitan's llama3 ``Attention.forward`` itself (same code object), with its global name
    ``apply_rotary_emb`` resolved to :func:`_rotary_emb_exact`: nothing of TorchTitan is modified."""
    from torchtitan.models.llama3.model.model import Attention

    original = Attention.forward
    namespace = {**original.__globals__, "apply_rotary_emb": _rotary_emb_exact}
    forward = types.FunctionType(
        original.__code__, namespace, original.__name__, original.__defaults__, original.__closure__
    )
    forward.__kwdefaults__ = original.__kwdefaults__
    forward.__qualname__, forward.__doc__, forward.__wrapped__ = (
        original.__qualname__,
        original.__doc__,
        original,
    )
    return forward


def _use_exact_rope(model: nn.Module) -> None:
    """Let this Llama3 model's RoPE keep fp64 inputs in fp64 (its own attention modules only).

    TorchTitan's ``apply_rotary_emb`` rounds q/k to fp32 (``xq.float()``) whatever the model dtype. In an fp64
    model that rounding turns 1e-16 differences between two correct schedules into 1e-8 ones, hiding the
    logic errors fp64 tests exist to catch. Each attention module of ``model`` gets TorchTitan's own forward
    bound with :func:`_rotary_emb_exact`; other models, and TorchTitan's module, are untouched.
    """
    from torchtitan.models.llama3.model.model import Attention

    forward = _exact_rope_attention_forward()
    for module in model.modules():
        if isinstance(module, Attention):
            module.forward = types.MethodType(forward, module)
