"""Which modules a LoRA cell's adapters wrap (``model.lora.target_modules``, resolved against the model)."""

from __future__ import annotations

import torch

from harness.spec.cell import LoraSpec


def projection_names(model: torch.nn.Module) -> list[str]:
    """The leaf names of the ``nn.Linear`` projections inside the decoder layers (``*_proj``: attention
    q/k/v/o or fused qkv, MLP gate/up/down or fused gate_up), sorted; the LM head and MoE routers excluded."""
    layers = model.get_decoder().layers if hasattr(model, "get_decoder") else model
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, mod in layers.named_modules()
            if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1].endswith("_proj")
        }
    )


def target_modules(model: torch.nn.Module, lora: LoraSpec) -> list[str]:
    """``lora.target_modules``, or the family's projections; ValueError naming the field when one of the given
    names is no projection of the model, or the model has none."""
    found = projection_names(model)
    if lora.target_modules is None:
        if not found:
            raise ValueError("lora.target_modules: the model has no *_proj linear layers; name the modules")
        return found
    linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    unknown = [n for n in lora.target_modules if n not in linear]
    if unknown:
        raise ValueError(
            f"lora.target_modules {unknown} are not linear layers of the model; its projections: {found}"
        )
    return list(lora.target_modules)
