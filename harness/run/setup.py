"""What one cell runs on: the device, a fresh model per contender (same seed), and the synthetic rollout group."""

from __future__ import annotations

import dataclasses
import math

import torch

from harness.contenders import get_contender
from harness.spec.cell import Cell
from prefixflow.model.dtypes import DTYPES

HF_PREFIX = "hf:"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but torch.cuda.is_available() is False")
    return torch.device(name)


def make_group(cell: Cell, vocab_size: int, index: int = 0):
    """A deterministic synthetic rollout group: prompt of P tokens, N responses of length S (or, with
    ``suffix_spread`` > 0, uniform in [ceil(S*(1-spread)), S]), advantages ~ N(0, 1). ``index``: which
    group of a multi-group step (each its own draw; index 0 is the single-group cell's group)."""
    from prefixflow import RolloutGroup

    gen = torch.Generator().manual_seed(cell.seed + 1_000_003 * index)
    if cell.vision is not None:
        raise ValueError("a vision cell's group needs its model: harness.run.setup.vision_group")
    prompt = torch.randint(0, vocab_size, (cell.prefix_len,), generator=gen)
    if cell.suffix_spread > 0:
        low = max(1, math.ceil(cell.suffix_len * (1 - cell.suffix_spread)))
        lens = torch.randint(low, cell.suffix_len + 1, (cell.n,), generator=gen).tolist()
    else:
        lens = [cell.suffix_len] * cell.n
    responses = [torch.randint(0, vocab_size, (s,), generator=gen) for s in lens]
    advantages = torch.randn(cell.n, generator=gen, dtype=torch.float64)
    return RolloutGroup(prompt=prompt, responses=responses, advantages=advantages)


def vision_group(cell: Cell, model: torch.nn.Module):
    """A vision cell's seeded group (``cell.vision``): the image or video prompt with its pixel inputs."""
    return cell.vision.group(model, cell.n, DTYPES[cell.dtype])


def build_cell_model(cell: Cell, device: torch.device) -> torch.nn.Module:
    """The cell's model with its seed's random weights: TorchTitan ``family:flavor``, or ``hf:<built-in config
    name | local config.json path>`` through ``prefixflow.integrations.hf`` (needs ``prefixflow[hf]``), with
    ``model.lora``: PEFT's LoRA adapters inside (seeded; base weights frozen, only the adapters train)."""
    kwargs = {
        "dtype": DTYPES[cell.dtype],
        "seed": cell.seed,
        "overrides": dict(cell.model.overrides),
        "device": device,
    }
    if cell.model.name.startswith(HF_PREFIX):
        from harness.vlm_models import build_vlm_model, freeze_tower, is_vlm_name
        from prefixflow.integrations.hf import build_hf_model

        if is_vlm_name(cell.model.name.removeprefix(HF_PREFIX)):
            model = build_vlm_model(cell.model.name.removeprefix(HF_PREFIX), **kwargs)
            if cell.tower == "frozen":
                freeze_tower(model)
            return model

        model = build_hf_model(cell.model.name.removeprefix(HF_PREFIX), **kwargs)
        if cell.model.lora is not None:  # PEFT's base model, LoRA inside the projections (harness.run.lora)
            from harness.run.lora import apply_lora

            model = apply_lora(model, cell.model.lora, cell.seed)
        return model
    from prefixflow import build_model

    return build_model(cell.model.name, **kwargs)


def with_routing(group, model: torch.nn.Module):
    """MoE models train under Rollout Routing Replay (the paper's MoE setting): the group carries the routing
    masks a rollout engine records, here recorded on ``model`` (untimed; the prefix routed once)."""
    from prefixflow.moe import is_moe, record_routing

    if not is_moe(model):
        return group
    return dataclasses.replace(group, routing=record_routing(model, group))


def build_for(name: str, cell: Cell, device: torch.device):
    """The contender ``name`` and a fresh model (same seed for every contender) transformed for it."""
    from prefixflow import apply_ac

    contender = get_contender(name)
    model = build_cell_model(cell, device)
    apply_ac(model, cell.ac)
    model = contender.prepare(model, cell)
    if cell.compile:
        from prefixflow.model.compile import apply_compile

        apply_compile(
            model
        )  # per-block, shared by every contender; the first (warm-up) step pays compile time
    return contender, model


def vocab_size_of(model: torch.nn.Module) -> int:
    from prefixflow import adapter_for

    return int(adapter_for(model).vocab_size(model))
