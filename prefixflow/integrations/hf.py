"""Hugging Face transformers causal LMs under PrefixFlow, through transformers' ``AttentionInterface``.

Importing this module registers an attention implementation named ``"prefixflow"`` (and, for the model's own
mask construction, sdpa's mask function under the same name) and :class:`HFAdapter` in
:mod:`prefixflow.model.adapters`. ``apply_prefixflow(model)`` then switches the model to ``attn_implementation=
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

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

try:
    from transformers import AttentionInterface, AutoModelForCausalLM, PreTrainedModel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "prefixflow.integrations.hf needs Hugging Face transformers: pip install 'prefixflow[hf]'"
    ) from exc

from ..attention.modes import AttentionState, PrefixAwareAttention
from ..model.adapters import ModelAdapter, register_adapter
from ..runtime import runtime_of
from ..tree.masks import MaskRules
from .hf_configs import (
    DROPOUT_CONFIG_FIELDS,
    HF_MODELS,
    UNSUPPORTED_CONFIG_FIELDS,
    VERIFIED_MODEL_TYPES,
    hf_config,
    list_hf_models,
)
from .hf_state import boundary_layers, install_boundaries
from .hf_vision import VLM_MODEL_TYPES, VisionLanguageMixin

__all__ = [
    "ATTENTION_NAME",
    "VERIFIED_MODEL_TYPES",
    "HF_MODELS",
    "HFAdapter",
    "VLM_MODEL_TYPES",
    "VisionLanguageAdapter",
    "build_hf_model",
    "hf_config",
    "list_hf_models",
]

ATTENTION_NAME = "prefixflow"
_WRAPPER = (
    "_prefixflow_attention"  # per-layer attribute (plain attribute: not a submodule, not in state_dict)
)


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
    verified_types = VERIFIED_MODEL_TYPES

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
        if config.model_type not in self.verified_types:
            raise ValueError(
                f"PrefixFlow's HF adapter is verified on model types {self.verified_types}; this model is "
                f"{config.model_type!r}. A type needs decoder layers whose self_attn calls transformers' attention "
                "interface after RoPE, no logit transform outside lm_head, and an fp64 equivalence test "
                "(tests/prefixflow/integrations/test_hf.py) before it joins VERIFIED_MODEL_TYPES"
            )
        set_fields = [f for f in UNSUPPORTED_CONFIG_FIELDS if getattr(config, f, None) not in (None, 1.0)]
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

    def windows(self, model) -> dict[int, int]:
        """The sliding window of each windowed attention layer, by wrapped layer index (transformers'
        semantics: a query at ``q`` sees keys ``k > q - window``)."""
        default = getattr(model.config.get_text_config(), "sliding_window", None)
        out = {}
        for attention in self.attentions(model):
            window = getattr(attention, "sliding_window", default)
            wrapper = attention.__dict__.get(_WRAPPER)
            if window is not None and wrapper is not None:
                out[wrapper.layer] = int(window)
        return out

    def mask_rules(self, model, tree, inputs):
        """Sliding windows the tree's paths outgrow: each windowed layer's queries see only the keys, cached
        prefix keys included, inside their window (prefixflow.tree.masks)."""
        longest = max(tree.path_lens)
        windows = {layer: w for layer, w in self.windows(model).items() if longest > w}
        return MaskRules(windows) if windows else None

    def check(self, model, group) -> None:
        for field in DROPOUT_CONFIG_FIELDS:
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


class VisionLanguageAdapter(VisionLanguageMixin, HFAdapter):
    """Vision-language ``*ForConditionalGeneration`` models (:data:`VLM_MODEL_TYPES`): images and video in the
    shared prompt, the vision tower once per group (:mod:`prefixflow.integrations.hf_vision`)."""


register_adapter(HFAdapter())
register_adapter(VisionLanguageAdapter())


# -- building HF models from configs (random weights, no download) ------------------------------------------


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
    runtime_of(model, create=True).name = f"hf:{name}"
    return model
