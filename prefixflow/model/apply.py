"""``apply_prefixflow`` and ``apply_ac``: TorchTitan-style in-place model transformations."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ..attention.modes import ATTENTION_VARIANTS, AttentionState
from ..memory.fake_tier import TIER_FAKE
from ..runtime import PrefixFlowRuntime, runtime_of
from .adapters import adapter_for

__all__ = ["PrefixFlowConfig", "PrefixFlowRuntime", "apply_prefixflow", "runtime_of", "apply_ac", "AC_MODES"]

AC_MODES = ("none", "selective", "full")
OFFLOAD_TIERS = ("auto", TIER_FAKE)


@dataclass(frozen=True)
class PrefixFlowConfig:
    """How PrefixFlow runs on a model.

    ``grad_kv_dtype``: dtype of the prefix K/V leaves and gK/gV accumulators; ``None`` = fp32 when the model's
    parameters are bf16/fp16, else the parameter dtype. ``attention``: how suffix attention reads the cache
    (``"concat"``: one SDPA over ``[prefix ; suffix]`` K/V under the layout's mask; ``"split"``: prefix and
    suffix parts merged by log-sum-exp, no K/V copy, causal suffix part without a mask; ``"auto"``: split on
    CPU, concat elsewhere: split's fused CUDA path, ATen's flash / memory-efficient kernels with their LSE, has
    no GPU measurement behind it yet). ``offload``: move the dormant saved tensors of the prefix graph out of
    device memory from Phase A to Phase C (``prefixflow.memory.offload``); ``offload_prefetch``: load them back ahead
    of the prefix backward (False = demand-load only); ``offload_tier``: where they go, ``"auto"`` (a pinned
    host pool on CUDA, a temporary file on CPU) or ``"fake"`` (an estimate under FakeTensorMode:
    ``prefixflow.memory.fake_tier``). ``memory_budget_bytes``: the peak device memory a
    ``train_group(..., microbatch="auto")`` call may use; it picks the largest microbatches that fit
    (``prefixflow.memory.budget``).
    """

    grad_kv_dtype: torch.dtype | None = None
    attention: str = "auto"
    offload: bool = False
    offload_prefetch: bool = True
    offload_tier: str = "auto"
    memory_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.attention not in ("auto", *ATTENTION_VARIANTS):
            raise ValueError(
                f"PrefixFlowConfig.attention {self.attention!r} unknown; valid: {('auto', *ATTENTION_VARIANTS)}"
            )
        if self.grad_kv_dtype is not None and not (
            isinstance(self.grad_kv_dtype, torch.dtype) and self.grad_kv_dtype.is_floating_point
        ):
            raise TypeError(
                f"PrefixFlowConfig.grad_kv_dtype must be a floating torch.dtype or None, got {self.grad_kv_dtype!r}"
            )
        for name in ("offload", "offload_prefetch"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"PrefixFlowConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.offload_tier not in OFFLOAD_TIERS:
            raise ValueError(
                f"PrefixFlowConfig.offload_tier {self.offload_tier!r} unknown; valid: {OFFLOAD_TIERS}"
            )
        budget = self.memory_budget_bytes
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(
                f"PrefixFlowConfig.memory_budget_bytes must be None or an int >= 1, got {budget!r}"
            )

    def attention_for(self, device: torch.device) -> str:
        """The suffix-attention variant to run on ``device`` (resolves ``"auto"``)."""
        if self.attention != "auto":
            return self.attention
        return "split" if device.type == "cpu" else "concat"


def apply_prefixflow(model: nn.Module, config: PrefixFlowConfig | None = None) -> nn.Module:
    """Wrap every attention layer of a model at its SDPA boundary (in place, idempotent).

    TorchTitan decoders are supported by the core; other families through their adapter
    (:mod:`prefixflow.model.adapters`; Hugging Face causal LMs: ``prefixflow.integrations.hf``). Afterwards
    ``model(tokens)`` is still the plain full-sequence forward; ``train_group`` switches the wrapped layers
    into prefix-capture (Phase A) or prefix-aware suffix attention (Phase B). Calling it again only updates
    the config.
    """
    config = config or PrefixFlowConfig()
    if not isinstance(config, PrefixFlowConfig):
        raise TypeError(f"config must be a PrefixFlowConfig, got {type(config).__name__}")
    runtime = runtime_of(model, create=True)
    if runtime.config is not None:
        runtime.config = replace(config)
        return model
    adapter = adapter_for(model)
    state = AttentionState()
    runtime.n_wrapped = adapter.wrap_attention(model, state)
    runtime.config, runtime.state, runtime.adapter = config, state, adapter
    return model


def apply_ac(model: nn.Module, mode: str = "selective") -> nn.Module:
    """Activation checkpointing on every block, the model family's own way (TorchTitan: ``selective`` =
    op-level SAC with TorchTitan's save list, ``full``; ``none`` does nothing). Works before or after
    ``apply_prefixflow``."""
    if mode not in AC_MODES:
        raise ValueError(f"AC mode {mode!r} unknown; valid: {AC_MODES}")
    if mode == "none":
        return model
    adapter_for(model).apply_ac(model, mode)
    runtime_of(model, create=True).ac = mode
    return model
