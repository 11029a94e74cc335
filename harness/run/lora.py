"""LoRA cells: an ``hf:`` model with PEFT's LoRA adapters inside its projections, as PrefixFlowGRPOTrainer
trains it (``PeftModel.get_base_model()``: the transformers model, base weights frozen, adapters trainable)."""

from __future__ import annotations

import torch

from harness.spec.cell import LoraSpec
from harness.spec.lora import target_modules


def apply_lora(model: torch.nn.Module, lora: LoraSpec, seed: int) -> torch.nn.Module:
    """Wrap ``model`` with PEFT's LoRA (rank ``r``, ``lora_alpha``, no dropout; adapter init under ``seed``, so
    every contender of a cell gets the same adapters) and return PEFT's base model: the transformers model
    with the LoRA layers inside its projections, its own weights frozen."""
    try:
        import peft
    except ImportError as e:
        raise ValueError(f"lora: LoRA cells need peft (pip install peft): {e}") from None
    config = peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=0.0,
        target_modules=target_modules(model, lora),
        bias="none",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        wrapped = peft.get_peft_model(model, config)
    base = wrapped.get_base_model()
    base.prefixflow_lora = lora
    return base
