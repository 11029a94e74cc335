"""Hugging Face transformers causal LMs under PrefixFlow, through transformers' ``AttentionInterface``.

Importing this module registers an attention implementation named ``"prefixflow"`` (and, for the model's own
mask construction, sdpa's mask function under the same name) and :class:`HFAdapter` in
:mod:`prefixflow.adapters`. ``apply_prefixflow(model)`` then switches the model to ``attn_implementation=
"prefixflow"`` and hands each attention layer a :class:`~prefixflow.attention.PrefixAwareAttention`:

- with no PrefixFlow phase running (generation, evaluation, TRL's own forwards), the registered function is
  transformers' sdpa path with every argument it was given: the model's own masks, positions and cache;
- during ``train_group`` the schedule's modes take over at the same point, after RoPE (and Qwen3's qk-norm):
  Phase A captures post-RoPE prefix K/V, Phase B attends to ``[cached prefix ; suffix]``. Positions reach
  RoPE as the model's ``position_ids``; no installed file is patched.

Verified (fp64 and fp32 gradients against the same model on full sequences): :data:`VERIFIED_MODEL_TYPES`
(Llama, Mistral, Qwen2/3, Gemma, Gemma-3, Phi, Phi-3, OLMo, OLMo-2, StableLM, StarCoder2, Helium; dense, GQA,
tied or untied embeddings), and the hybrids ``qwen3_5_text`` (gated DeltaNet + attention), ``nemotron_h``
(Mamba-2 + attention + MLP blocks), ``granitemoehybrid`` (Granite-4 hybrid, dense: ``num_local_experts=0``)
and ``bamba`` (Mamba-2 + attention), whose recurrent layers cache their state
(:mod:`prefixflow.integrations.hf_state`). Other model types raise at ``apply_prefixflow``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

try:
    import transformers
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, PreTrainedModel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "prefixflow.integrations.hf needs Hugging Face transformers: pip install 'prefixflow[hf]'"
    ) from exc

from ..adapters import ModelAdapter, register_adapter
from ..attention import AttentionState, PrefixAwareAttention
from .hf_state import boundary_layers, install_boundaries

__all__ = [
    "ATTENTION_NAME",
    "VERIFIED_MODEL_TYPES",
    "HF_MODELS",
    "HFAdapter",
    "build_hf_model",
    "list_hf_models",
]

ATTENTION_NAME = "prefixflow"
VERIFIED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3",
    "gemma", "gemma3_text", "phi", "phi3", "olmo", "olmo2", "stablelm", "starcoder2", "helium",
    "qwen3_5_text", "nemotron_h", "granitemoehybrid", "bamba",
)  # fmt: skip
_WRAPPER = (
    "_prefixflow_attention"  # per-layer attribute (plain attribute: not a submodule, not in state_dict)
)
# Config fields that change what the LM head or attention computes beyond what PrefixFlow reproduces.
_UNSUPPORTED_CONFIG = (
    "attn_logit_softcapping", "final_logit_softcapping", "logit_scale", "logits_scaling",
)  # fmt: skip
# Dropout fields (training with any of them non-zero would differ from the baseline).
_DROPOUT_CONFIG = (
    "attention_dropout", "resid_pdrop", "embd_pdrop", "hidden_dropout", "residual_dropout",
    "embedding_dropout",
)  # fmt: skip


def _prefixflow_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The registered attention function: transformers' sdpa unless a PrefixFlow phase is running."""
    wrapper = module.__dict__.get(_WRAPPER)
    if wrapper is None or wrapper.state.mode is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout:
        raise RuntimeError("PrefixFlow phases need attention dropout 0 (set config.attention_dropout=0.0)")
    query, key, value = _sdpa_dtype(query, key, value)
    out = wrapper(query, key, value, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _sdpa_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q/k/v in the dtype sdpa computes in: the autocast dtype when autocast is on (Qwen3's qk-norm leaves q/k in
    fp32 while v is bf16), else their common dtype. The cache then holds what every phase reads."""
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = tensors[0].dtype
        for t in tensors[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
    return tuple(t if t.dtype == dtype else t.to(dtype) for t in tensors)


def _causal_sdpa(q, k, v, *, scale=None, enable_gqa=False, is_causal=True):
    """Phase A's attention over the prefix: plain causal SDPA, the call transformers' sdpa makes without a mask."""
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=is_causal and q.shape[-2] > 1, scale=scale, enable_gqa=enable_gqa
    )


AttentionInterface.register(ATTENTION_NAME, _prefixflow_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


class HFAdapter(ModelAdapter):
    """Hugging Face ``*ForCausalLM`` models: ``base_model`` (embeddings, ``layers``, norm, rotary) and the output
    embeddings as LM head. Attention enters through the registered ``"prefixflow"`` implementation."""

    name = "hf"

    def matches(self, model: nn.Module) -> bool:
        return isinstance(model, PreTrainedModel) and hasattr(getattr(model, "base_model", None), "layers")

    def hidden(self, model, tokens, positions, *, final_norm=True):
        # The base model always applies its final norm; Phase A stops before it (PrefixCaptured).
        out = model.base_model(input_ids=tokens, position_ids=positions, use_cache=False)
        return out.last_hidden_state

    def lm_head(self, model):
        return model.get_output_embeddings()

    def vocab_size(self, model):
        return int(model.config.get_text_config().vocab_size)

    def max_seq_len(self, model):
        return int(model.config.get_text_config().max_position_embeddings)

    max_seq_len_field = "max_position_embeddings"

    def blocks(self, model):
        return list(model.base_model.layers)

    def block_is_checkpointed(self, block):
        return bool(getattr(block, "gradient_checkpointing", False)) and block.training

    def wrap_attention(self, model, state: AttentionState) -> int:
        config = model.config
        if config.model_type not in VERIFIED_MODEL_TYPES:
            raise ValueError(
                f"PrefixFlow's HF adapter is verified on model types {VERIFIED_MODEL_TYPES}; this model is "
                f"{config.model_type!r}. A type needs decoder layers whose self_attn calls transformers' attention "
                "interface after RoPE, no logit transform outside lm_head, and an fp64 equivalence test "
                "(tests/prefixflow/integrations/test_hf.py) before it joins VERIFIED_MODEL_TYPES"
            )
        set_fields = [f for f in _UNSUPPORTED_CONFIG if getattr(config, f, None) not in (None, 1.0)]
        if set_fields:
            raise ValueError(f"PrefixFlow does not reproduce config fields {set_fields}; unset them")
        impl = config._attn_implementation
        if impl not in ("sdpa", ATTENTION_NAME):
            raise ValueError(
                f"PrefixFlow wraps transformers' sdpa attention; this model uses {impl!r}. Load it with "
                "attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))"
            )
        layers = boundary_layers(config.get_text_config(), self.blocks(model), self.state_rule)
        if not layers or any(kind == "attention" and not hasattr(m, "layer_idx") for kind, m, _, _ in layers):
            raise ValueError(
                "every attention layer needs a layer_idx (a transformers decoder), and a model at least one "
                "attention or recurrent layer"
            )

        def wrap(attention, n):
            object.__setattr__(attention, _WRAPPER, PrefixAwareAttention(_causal_sdpa, n, state))

        n = install_boundaries(config.get_text_config(), self.blocks(model), state, wrap, self.state_rule)
        model.set_attn_implementation(ATTENTION_NAME)
        return n

    def attentions(self, model) -> list[nn.Module]:
        """The model's attention modules (hybrid models have recurrent layers besides)."""
        layers = boundary_layers(model.config.get_text_config(), self.blocks(model), self.state_rule)
        return [m for kind, m, _, _ in layers if kind == "attention"]

    def check(self, model, group) -> None:
        longest = group.prompt_len + max(group.response_lens)
        for attention in self.attentions(model):
            window = getattr(attention, "sliding_window", getattr(model.config, "sliding_window", None))
            if window is not None and longest > window:
                raise ValueError(
                    f"prompt + longest response = {longest} tokens exceeds the model's sliding_window={window}; "
                    "PrefixFlow attends to the whole cached prefix (shorten the group or disable the window)"
                )
        for field in _DROPOUT_CONFIG:
            if model.training and float(getattr(model.config, field, 0.0) or 0.0) > 0:
                raise ValueError(
                    f"config.{field} must be 0 while training with PrefixFlow (or call model.eval())"
                )
        for layer in self.blocks(model):
            func = getattr(layer, "_gradient_checkpointing_func", None)
            if self.block_is_checkpointed(layer) and getattr(func, "keywords", {}).get(
                "use_reentrant", False
            ):
                raise ValueError(
                    "reentrant gradient checkpointing hides the prefix K/V from autograd; enable it with "
                    "activation_checkpointing_kwargs={'use_reentrant': False}"
                )

    def fsdp_units(self, model):
        """``embed_tokens`` (untied), each decoder layer, then the final norm with the LM head (and a tied
        embedding): every module with parameters after the layers, found from the model, not by name."""
        base, blocks = model.base_model, self.blocks(model)
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        names = {id(m): n for n, m in model.named_modules()}
        skip = {id(base.layers), id(embed), id(head), id(base)}
        rest = [
            m
            for parent in (base, model)
            for m in parent.children()
            if id(m) not in skip and any(True for _ in m.parameters())
        ]
        tied = head.weight is embed.weight
        units: list[tuple[str, nn.Module | list[nn.Module]]] = []
        if not tied:
            units.append((names[id(embed)], embed))
        units += [(names[id(b)], b) for b in blocks]
        last = ([embed] if tied else []) + rest + [head]
        units.append(("+".join(names[id(m)] for m in last), last))
        return units

    def apply_ac(self, model, mode):
        if mode != "full":
            raise ValueError(
                f"AC mode {mode!r} is TorchTitan's; Hugging Face models checkpoint whole layers: use 'full'"
            )
        enable_checkpointing(model, use_reentrant=False)
        model.train()


def enable_checkpointing(model, *, use_reentrant: bool) -> None:
    """HF's own gradient checkpointing: ``activation_checkpointing_enable`` (transformers 5.24) or, before that
    rename, ``gradient_checkpointing_enable`` (e.g. 5.10, which verl 0.9.1 needs)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": use_reentrant}
        )
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})


register_adapter(HFAdapter())


# -- building HF models from configs (random weights, no download) ------------------------------------------

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
        config = AutoConfig.for_model(model_type, **raw)
    except (ValueError, KeyError) as exc:
        raise ValueError(
            f"transformers {transformers.__version__} cannot build model type {model_type!r}: {exc}"
        ) from None
    for key, value in dict(overrides or {}).items():
        if not hasattr(config, key):
            raise ValueError(f"unknown override field {key!r} for HF model type {model_type!r}")
        setattr(config, key, value)
    _check_config(config, name)
    return config


_POSITIVE_INT_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
)


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


def build_hf_model(
    name: str,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    device: str | torch.device = "cpu",
) -> PreTrainedModel:
    """An HF causal LM with deterministic random weights (transformers' own init under ``seed``), sdpa
    attention, from a built-in config name or a local config path. No weights or code are downloaded."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    config = hf_config(name, overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.to(device)
    model.prefixflow_name = f"hf:{name}"
    return model
