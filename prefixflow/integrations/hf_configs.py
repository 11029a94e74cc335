"""The HF model types PrefixFlow's adapter is verified on, the config fields it refuses, and the built-in
random-weight configs (``hf:NAME`` in pf-bench): :func:`hf_config` builds a checked transformers config from a
built-in name or a local ``config.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoConfig

__all__ = [
    "VERIFIED_MODEL_TYPES",
    "UNSUPPORTED_CONFIG_FIELDS",
    "DROPOUT_CONFIG_FIELDS",
    "HF_MODELS",
    "hf_config",
    "list_hf_models",
    "TYPE_ADVICE",
    "require_transformers",
]

VERIFIED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3",
    "gemma", "gemma3_text", "phi", "phi3", "olmo", "olmo2", "stablelm", "starcoder2", "helium",
    "qwen3_5_text", "nemotron_h", "granitemoehybrid", "bamba",
)  # fmt: skip
# Config fields that change what the LM head or attention computes beyond what PrefixFlow reproduces.
UNSUPPORTED_CONFIG_FIELDS = (
    "attn_logit_softcapping", "final_logit_softcapping", "logit_scale", "logits_scaling",
)  # fmt: skip
# Dropout fields (training with any of them non-zero would differ from the baseline).
DROPOUT_CONFIG_FIELDS = (
    "attention_dropout", "resid_pdrop", "embd_pdrop", "hidden_dropout", "residual_dropout",
    "embedding_dropout",
)  # fmt: skip
# Said after a type refusal of an override (transformers' messages don't say what to give instead).
TYPE_ADVICE = "give a value of the field's type, e.g. 1.0 for a float, 1 for an int, true/false for a bool"


def require_transformers(minimum: str, what: str, why: str) -> None:
    """Refuse ``what`` in one line when the installed transformers is older than ``minimum`` (the oldest on
    which it was verified; ``why``: what is not verified below it)."""
    from packaging.version import Version

    if Version(transformers.__version__) < Version(minimum):
        raise ValueError(
            f"{what} need transformers >= {minimum}, found {transformers.__version__}: {why} "
            "(pip install 'prefixflow[hf]')"
        )


_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
# The TorchTitan debug models' shapes (llama3:debugmodel, qwen3:debugmodel), for side-by-side speed rows.
HF_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-tiny": ("llama", {**_TINY, "num_key_value_heads": 2, "vocab_size": 256}),
    "mistral-tiny": ("mistral", {**_TINY, "num_key_value_heads": 2, "vocab_size": 256, "head_dim": 16}),
    "qwen2-tiny": ("qwen2", {**_TINY, "num_key_value_heads": 2, "vocab_size": 256}),
    "qwen3-tiny": ("qwen3", {**_TINY, "num_key_value_heads": 2, "vocab_size": 256, "head_dim": 16}),
    "gemma-tiny": ("gemma", {**_TINY, "num_key_value_heads": 2, "vocab_size": 256, "head_dim": 16}),
    "gemma3-tiny": (
        "gemma3_text",
        {**_TINY, "num_key_value_heads": 2, "vocab_size": 256, "head_dim": 16, "sliding_window": 64},
    ),
    "phi-tiny": ("phi", {**_TINY, "num_key_value_heads": 2, "vocab_size": 256}),
    "phi3-tiny": ("phi3", {**_TINY, "num_key_value_heads": 2, "vocab_size": 256, "pad_token_id": 0}),
    "olmo-tiny": ("olmo", {**_TINY, "num_key_value_heads": 2, "vocab_size": 256, "pad_token_id": 0}),
    "olmo2-tiny": ("olmo2", {**_TINY, "num_key_value_heads": 2, "vocab_size": 256, "pad_token_id": 0}),
    "stablelm-tiny": ("stablelm", {**_TINY, "num_key_value_heads": 2, "vocab_size": 256}),
    "starcoder2-tiny": ("starcoder2", {**_TINY, "num_key_value_heads": 2, "vocab_size": 256}),
    "helium-tiny": ("helium", {**_TINY, "num_key_value_heads": 2, "vocab_size": 256, "head_dim": 16}),
    # Hybrids: Qwen3.5 (gated DeltaNet, GQA 2 key over 4 value heads; attention every 3rd layer) and Nemotron-H
    # (Mamba-2, attention, MLP blocks). Their recurrent layers cache their state (integrations/hf_state.py).
    "qwen3_5-tiny": (
        "qwen3_5_text",
        {
            **_TINY,
            "num_hidden_layers": 3,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": 256,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "layer_types": ["linear_attention", "linear_attention", "full_attention"],
        },
    ),  # fmt: skip
    "nemotron_h-tiny": (
        "nemotron_h",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": 256,
            "layers_block_type": ["linear_attention", "full_attention", "mlp"],
            "ssm_state_size": 16,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "n_groups": 2,
            "chunk_size": 32,
        },
    ),  # fmt: skip
    "llama-debug": (
        "llama",
        {
            "hidden_size": 256,
            "intermediate_size": 768,
            "num_hidden_layers": 6,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "vocab_size": 2048,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
        },
    ),
    "qwen3-debug": (
        "qwen3",
        {
            "hidden_size": 256,
            "intermediate_size": 3072,
            "num_hidden_layers": 8,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 2048,
            "tie_word_embeddings": True,
        },
    ),
    # Llama-3-8B's shape (random weights): for paper-scale rows on a GPU next to TorchTitan's llama3:8B.
    "llama3-8b": (
        "llama",
        {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "max_position_embeddings": 131072,
        },
    ),
}
_MAX_CONFIG_BYTES = 1 << 20
_COMMON = {"max_position_embeddings": 8192, "attention_dropout": 0.0}


def list_hf_models() -> list[str]:
    """The built-in config names ``build_hf_model`` accepts (besides a local config path)."""
    return sorted(HF_MODELS)


def hf_config(name: str, overrides: dict[str, Any] | None = None):
    """A transformers config from a built-in name (:data:`HF_MODELS`) or a local ``config.json`` (file or
    folder); never downloads. ``overrides`` set existing config fields (unknown names raise)."""
    if name in HF_MODELS:
        model_type, fields = HF_MODELS[name]
        raw = {"model_type": model_type, **_COMMON, **fields}
    else:
        path = Path(name)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(
                f"HF model {name!r} is neither a built-in config ({list_hf_models()}) nor a local config.json"
            )
        if path.stat().st_size > _MAX_CONFIG_BYTES:
            raise ValueError(f"{path} is larger than {_MAX_CONFIG_BYTES} bytes; not a model config")
        try:
            raw = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
            raise ValueError(f"{path} is not a transformers config.json (no 'model_type')")
    model_type = raw.pop("model_type")
    raw.pop("architectures", None)
    raw.pop("auto_map", None)  # remote code is never run
    try:
        default = AutoConfig.for_model(model_type, **raw)
    except (ValueError, KeyError) as exc:
        raise ValueError(
            f"transformers {transformers.__version__} cannot build model type {model_type!r}: {exc}"
        ) from None
    overrides = dict(overrides or {})
    for key in overrides:
        if not hasattr(default, key):
            raise ValueError(f"unknown override field {key!r} for HF model type {model_type!r}")
    config = _with_overrides(model_type, raw, overrides, default) if overrides else default
    _check_config(config, name)
    return config


def _with_overrides(model_type: str, raw: dict, overrides: dict, default):
    """The config built with ``overrides`` among its arguments (so the fields derived from them, e.g.
    ``layer_types`` from ``num_hidden_layers``, follow), refusing an override the built config does not hold:
    a field another one governs (NemotronH's depth is ``len(layers_block_type)``)."""
    raw = {k: v for k, v in raw.items() if k not in overrides and not _derived(model_type, raw, k)}
    try:
        config = AutoConfig.for_model(model_type, **{**raw, **overrides})
    except Exception as exc:  # noqa: BLE001 - transformers' strict dataclass validators raise their own types
        cause = " ".join(str(exc).strip().splitlines()[-1].split())[:200]
        given = ", ".join(f"{k}={v!r}" for k, v in overrides.items())
        typed = "expected" in cause or isinstance(exc, TypeError)
        raise ValueError(
            f"override {given}: HF model type {model_type!r} refuses it: {cause}"
            + (f" ({TYPE_ADVICE})" if typed else "")
        ) from None
    for key, value in overrides.items():
        built = getattr(config, key)
        if built != value:
            governs = _governing_field(default.to_dict(), built, key)
            raise ValueError(
                f"override {key}={value!r} does not take effect: HF model type {model_type!r} builds {key}="
                f"{built!r} from {governs}; set {governs} instead (in a local config.json: hf:PATH)"
            )
    return config


def _derived(model_type: str, raw: dict, key: str) -> bool:
    """Whether list field ``key`` (a saved config.json's ``layer_types``) is what the model type derives from
    the other fields anyway; then it follows the overrides instead of contradicting them."""
    if not isinstance(raw[key], list):
        return False
    try:
        return (
            getattr(AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k != key}), key)
            == raw[key]
        )
    except Exception:  # noqa: BLE001 - without it the config is invalid: it is not derived
        return False


def _governing_field(fields: dict, built, key: str) -> str:
    """The config field the built value of ``key`` comes from: a list of that length (a per-layer pattern)."""
    if isinstance(built, int) and not isinstance(built, bool):
        lists = [k for k, v in fields.items() if k != key and isinstance(v, list) and len(v) == built]
        if lists:
            return lists[0]
    return "another config field"


_POSITIVE_INT_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
)
# The recurrent layers' sizes (Qwen3.5's gated DeltaNet, Mamba-2), checked where the model type has them.
_STATE_INT_FIELDS = (
    "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
    "linear_num_value_heads", "ssm_state_size", "mamba_num_heads", "mamba_head_dim", "n_groups", "conv_kernel",
    "chunk_size",
)  # fmt: skip
# (heads, groups): the first must be a multiple of the second
_STATE_DIVISORS = (("linear_num_value_heads", "linear_num_key_heads"), ("mamba_num_heads", "n_groups"))


def _check_config(config, name: str) -> None:
    """The config fields a model is built from, checked before any weight exists (one-line ValueError
    naming the field): a verified model type, positive sizes, heads that divide."""
    if config.model_type not in VERIFIED_MODEL_TYPES:
        raise ValueError(
            f"HF model {name!r} has model_type {config.model_type!r}; PrefixFlow's HF adapter supports "
            f"{list(VERIFIED_MODEL_TYPES)}"
        )
    for field in _POSITIVE_INT_FIELDS:
        value = getattr(config, field, None)
        if value is None and field == "num_key_value_heads":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{field}={value!r} must be an integer >= 1")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} must be a multiple of num_key_value_heads={kv_heads}")
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None and config.hidden_size % heads:
        raise ValueError(f"hidden_size={config.hidden_size} must be divisible by num_attention_heads={heads}")
    if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1):
        raise ValueError(f"head_dim={head_dim!r} must be an integer >= 1")
    present = config.to_dict()
    for field in _STATE_INT_FIELDS:
        value = present.get(field)
        if field in present and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{field}={value!r} must be an integer >= 1")
    for heads, groups in _STATE_DIVISORS:
        if heads in present and groups in present and present[heads] % present[groups]:
            raise ValueError(
                f"{heads}={present[heads]} must be a multiple of {groups}={present[groups]}; change either"
            )
