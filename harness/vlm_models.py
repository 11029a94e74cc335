"""The ``hf:`` vision-language entries of pf-bench: random-weight Qwen2.5-VL configs built here (no hub, no
download), beside the text configs of ``prefixflow.integrations.hf_configs``.

Overrides name a language-model field as it is (``num_hidden_layers``) or a vision-tower field with the
prefix ``vision_`` (``vision_depth``); an unknown name, or one the built config does not hold, is refused.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "VLM_MODELS",
    "is_vlm_name",
    "vlm_config",
    "model_class",
    "build_vlm_model",
    "freeze_tower",
    "tower_modules",
]

_VOCAB = 2048
# Placeholder ids at the top of the vocabulary; prompt text is drawn below them (harness.vision_workloads).
_IDS = dict(image_token_id=_VOCAB - 4, video_token_id=_VOCAB - 3, vision_start_token_id=_VOCAB - 2,
            vision_end_token_id=_VOCAB - 1)  # fmt: skip


def _qwen25(text: dict[str, Any], vision: dict[str, Any]) -> dict[str, Any]:
    half = text["hidden_size"] // text["num_attention_heads"] // 2  # mRoPE: (t, h, w) sections of each head
    rope = {"rope_type": "default", "mrope_section": [half // 4, half * 3 // 8, half * 3 // 8],
            "rope_theta": 1000000.0}  # fmt: skip
    return {
        "text_config": {
            "vocab_size": _VOCAB, "max_position_embeddings": 32768, "attention_dropout": 0.0,
            "rope_parameters": rope, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 0, **text,
        },
        "vision_config": {
            "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
            "in_channels": 3, **vision,
        },
        **_IDS,
    }  # fmt: skip


# Qwen2.5-VL-3B's proportions scaled down: the tower is 0.6x the LM's width, about 2.7x wide in its MLP, its
# attention windowed (112 px windows) except in its last block, which attends over each whole frame.
VLM_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2_5_vl-tiny": (  # tests: a 2-layer LM of width 64, a 2-block tower of width 32
        "qwen2_5_vl",
        _qwen25(
            {
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
            },
            {
                "depth": 2,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_heads": 2,
                "out_hidden_size": 64,
                "fullatt_block_indexes": [1],
            },
        ),
    ),  # fmt: skip
    "qwen2_5_vl-small": (  # benchmarks: a 2-layer LM of width 128, a 2-block tower of width 80
        "qwen2_5_vl",
        _qwen25(
            {
                "hidden_size": 128,
                "intermediate_size": 688,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
            },
            {
                "depth": 2,
                "hidden_size": 80,
                "intermediate_size": 216,
                "num_heads": 2,
                "out_hidden_size": 128,
                "fullatt_block_indexes": [1],
            },
        ),
    ),  # fmt: skip
}
VISION_PREFIX = "vision_"


def is_vlm_name(name: str) -> bool:
    """Whether ``name`` (without ``hf:``) is one of :data:`VLM_MODELS`."""
    return name in VLM_MODELS


def vlm_config(name: str, overrides: dict[str, Any] | None = None):
    """The transformers config of the built-in VLM ``name`` with ``overrides`` (ValueError naming the field)."""
    from transformers import AutoConfig

    model_type, fields = VLM_MODELS[name]
    text, vision = dict(fields["text_config"]), dict(fields["vision_config"])
    for key, value in (overrides or {}).items():
        part, field = (
            (vision, key.removeprefix(VISION_PREFIX)) if key.startswith(VISION_PREFIX) else (text, key)
        )
        part[field] = value
    probe = AutoConfig.for_model(model_type, **{**fields})
    for key in overrides or {}:
        sub = probe.vision_config if key.startswith(VISION_PREFIX) else probe.text_config
        if not hasattr(sub, key.removeprefix(VISION_PREFIX)):
            where = "vision tower" if key.startswith(VISION_PREFIX) else "language model"
            raise ValueError(
                f"unknown override field {key!r} for hf:{name}: its {where} config has no such field (a tower "
                f"field takes the prefix {VISION_PREFIX!r}, e.g. vision_depth)"
            )
    try:
        config = AutoConfig.for_model(model_type, **{**fields, "text_config": text, "vision_config": vision})
    except Exception as exc:  # noqa: BLE001 - transformers' validators raise their own types
        cause = " ".join(str(exc).strip().splitlines()[-1].split())[:200]
        given = ", ".join(f"{k}={v!r}" for k, v in (overrides or {}).items())
        raise ValueError(f"override {given} of hf:{name}: refused by transformers: {cause}") from None
    for key, value in (overrides or {}).items():
        sub = config.vision_config if key.startswith(VISION_PREFIX) else config.text_config
        if getattr(sub, key.removeprefix(VISION_PREFIX)) != value:
            raise ValueError(f"override {key}={value!r} does not take effect in hf:{name}; drop it")
    _check(config, name)
    return config


def _check(config, name: str) -> None:
    text, vision = config.text_config, config.vision_config
    for where, sub, fields in (
        ("", text, ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "max_position_embeddings")),
        (VISION_PREFIX, vision, ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size",
                                 "patch_size", "spatial_merge_size", "temporal_patch_size", "window_size")),
    ):  # fmt: skip
        for field in fields:
            value = getattr(sub, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"hf:{name}: {where}{field}={value!r} must be an integer >= 1")
    if text.num_attention_heads % text.num_key_value_heads or text.hidden_size % text.num_attention_heads:
        raise ValueError(
            f"hf:{name}: num_attention_heads={text.num_attention_heads} must divide hidden_size and be a multiple "
            f"of num_key_value_heads={text.num_key_value_heads}"
        )
    if vision.hidden_size % (4 * vision.num_heads):
        raise ValueError(
            f"hf:{name}: vision_hidden_size={vision.hidden_size} must be a multiple of 4 x vision_num_heads="
            f"{vision.num_heads} (the tower's 2-D rotary halves each head)"
        )
    bad = [i for i in vision.fullatt_block_indexes if not 0 <= i < vision.depth]
    if bad:
        raise ValueError(
            f"hf:{name}: vision_fullatt_block_indexes {bad} are outside the {vision.depth} blocks"
        )


def model_class(config):
    """The transformers class of a vision-language ``config`` (None for any other config)."""
    if getattr(config, "model_type", None) != "qwen2_5_vl":
        return None
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration


def build_vlm_model(name: str, *, dtype=torch.float32, seed: int = 0, overrides=None, device="cpu"):
    """The built-in VLM ``name`` with deterministic random weights (transformers' init under ``seed``), sdpa."""
    from prefixflow.runtime import runtime_of

    config = vlm_config(name, overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)(config).to(dtype)
    model.set_attn_implementation("sdpa")
    model.to(device)
    runtime_of(model, create=True).name = f"hf:{name}"
    return model


def tower_modules(model) -> list[torch.nn.Module]:
    """The modules the vision encoding runs (the family's own list: tower and projector)."""
    from prefixflow.integrations.hf_vision import FAMILIES

    return FAMILIES[model.config.model_type].encoder_modules(model)


def freeze_tower(model) -> None:
    """The common frozen-tower practice: the tower's parameters stop requiring grad (it then runs under
    ``no_grad`` and has no backward)."""
    for module in tower_modules(model):
        for p in module.parameters():
            p.requires_grad_(False)
