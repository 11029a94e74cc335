"""Hybrid Hugging Face models: the recurrent mixers' state rule and the per-layer boundary scan.

transformers' recurrent mixers (Qwen3.5's ``Qwen3_5GatedDeltaNet``; the Mamba-2 mixers of Nemotron-H, Granite-4
hybrid and Bamba: ``NemotronHMamba2Mixer``, ``GraniteMoeHybridMambaLayer``, ``BambaMixer``) read
and write their state through one cache interface: ``get_conv_state`` / ``get_recurrent_state``,
``update_conv_state`` (returns ``[conv tail ; new inputs]`` for the causal convolution) and
``update_recurrent_state``. :class:`HFRecurrentRule` runs the mixer's own forward with a
:class:`BoundaryCache` in that place: it hands the mixer the cached prefix state (Phase B) or the zero state
(Phase A, the baseline) and records the end state and the conv tail, the last ``kernel - 1`` pre-convolution
inputs. So the mixer's installed code (its convolution, chunked kernel, gating and norms) is what runs, through
transformers' PyTorch reference paths; no installed file is patched.

:func:`boundary_layers` classifies every decoder layer: attention (cached as K/V), a recurrent mixer with a
registered rule (cached as its state), state-free (an MLP block), or refused by name.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.modes import AttentionState
from ..state.layers import StatefulLayer, StateRule, register_state_rule, state_rule_for
from .hf_configs import require_transformers

__all__ = [
    "BoundaryCache",
    "HFRecurrentRule",
    "RECURRENT_MIXERS",
    "boundary_layers",
    "install_state_layer",
    "STATE_ATTR",
]

STATE_ATTR = "_prefixflow_state"  # per-mixer plain attribute: its StatefulLayer
# The recurrent mixers verified under PrefixFlow (module class names), and the layer types with no boundary.
RECURRENT_MIXERS = (
    "Qwen3_5GatedDeltaNet",
    "NemotronHMamba2Mixer",
    "GraniteMoeHybridMambaLayer",
    "BambaMixer",
)
_STATE_FREE_TYPES = ("mlp",)
# The recurrent mixers' state path is verified (fp64-exact) on transformers 5.24.0, the [hf] pin; on 5.17.0 (the
# lent GPU machine's) PrefixFlow's loss differs from the baseline's by ~1e-3 in fp64, so older ones are refused.
HYBRID_MIN_TRANSFORMERS = "5.24.0"


class BoundaryCache:
    """The cache a transformers recurrent mixer reads for one call: ``initial`` (``{"recurrent", "conv"}``,
    already expanded over the batch) or None for the zero state. Records ``final`` (end state and conv tail).
    Never the in-place decode step: ``is_recording_past`` is True, so the mixer runs its chunked path."""

    def __init__(self, initial: dict[str, torch.Tensor] | None, kernel: int) -> None:
        self.initial, self.kernel = initial, kernel
        self.final: dict[str, torch.Tensor] = {}

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return None if self.initial is None else self.initial["conv"]

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return None if self.initial is None else self.initial["recurrent"]

    def is_recording_past(self, layer_idx: int) -> bool:
        return True

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        full = conv_states if self.initial is None else torch.cat([self.initial["conv"], conv_states], dim=-1)
        keep = self.kernel - 1
        tail = (full[..., -keep:] if keep else full[..., :0]).clone()  # not a view: the inputs stay dormant
        if tail.shape[-1] < keep:  # a prefix shorter than the kernel: the zeros the causal conv pads with
            tail = F.pad(tail, (keep - tail.shape[-1], 0))
        self.final["conv"] = tail
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kw
    ):
        self.final["recurrent"] = recurrent_states
        return recurrent_states


class HFRecurrentRule(StateRule):
    """A transformers recurrent mixer from its boundary ``(recurrent state, conv tail)``: its own forward with a
    :class:`BoundaryCache`. A one-token call from a given state is padded to two tokens (and the pad's output
    dropped), so the mixer never takes its single-token decode path, which updates the state in place."""

    names = ("recurrent", "conv")

    def run(self, module, hidden, initial, kwargs):
        n, length = hidden.shape[:2]
        if initial is not None:
            initial = {name: t.expand(n, *t.shape[1:]) for name, t in initial.items()}
        if kwargs.get("attention_mask") is not None:
            raise ValueError(
                f"{type(module).__name__} under PrefixFlow takes no padding mask (the layout places pads)"
            )
        kwargs = {k: v for k, v in kwargs.items() if k not in ("cache", "cache_params")}
        # From a given state, a one-token call would take the mixer's decode step, which writes the state in
        # place: pad it to two tokens (causal: the pad changes nothing before it). From the zero state the
        # chunked path runs anyway, and the end state must be the real token's, so no pad.
        x = F.pad(hidden, (0, 0, 0, 1)) if length == 1 and initial is not None else hidden
        cache = BoundaryCache(initial, int(module.conv_kernel_size))
        out = type(module).forward(module, x, cache=cache, **kwargs)
        return out[:, :length], cache.final


for _name in RECURRENT_MIXERS:
    register_state_rule(_name, HFRecurrentRule())


def _dispatch(self, *args, **kwargs):
    """A recurrent mixer's forward: its StatefulLayer's phase dispatch (its own forward with no phase)."""
    return self.__dict__[STATE_ATTR](self, args, kwargs)


def install_state_layer(module: nn.Module, layer: StatefulLayer) -> None:
    """Route ``module``'s forward through ``layer`` (an instance attribute; the class is untouched)."""
    object.__setattr__(module, STATE_ATTR, layer)
    module.forward = types.MethodType(_dispatch, module)


def _layer_type(config, block: nn.Module, index: int) -> str:
    types_ = getattr(config, "layer_types", None)
    if isinstance(types_, (list, tuple)) and index < len(types_):
        return str(types_[index])
    return str(getattr(block, "block_type", getattr(block, "layer_type", "decoder")))


def _class_name(module: nn.Module) -> str:
    return type(module).__name__


def _attention_of(block: nn.Module) -> nn.Module | None:
    found = getattr(block, "self_attn", None)
    if found is not None:
        return found
    return next(
        (c for c in block.children() if type(c).__name__.endswith("Attention") and hasattr(c, "layer_idx")),
        None,
    )


def boundary_layers(
    config, blocks: list[nn.Module], rule_for=state_rule_for
) -> list[tuple[str, nn.Module, StateRule | None, str]]:
    """``(kind, module, rule, layer type)`` for every boundary of the decoder, in forward order: ``kind``
    ``"attention"`` (its module caches K/V) or ``"state"`` (a recurrent mixer with its rule). State-free
    layers (an MLP block) have none. Raises ``ValueError`` naming a layer type PrefixFlow has no rule for."""
    found = []
    for i, block in enumerate(blocks):
        layer_type = _layer_type(config, block, i)
        experts = [n for n in map(_class_name, block.children()) if n.lower().endswith(("moe", "moeblock"))]
        if experts:
            raise ValueError(
                f"layer {i} (layer type {layer_type!r}) has MoE experts {experts}; PrefixFlow replays MoE "
                "routing on TorchTitan models only"
            )
        attention = _attention_of(block)
        mixers = [(c, rule) for c in block.children() if (rule := rule_for(c)) is not None]
        if attention is not None and mixers:
            raise ValueError(
                f"layer {i} ({layer_type!r}) runs attention and a recurrent mixer side by side; PrefixFlow "
                "caches one boundary per layer"
            )
        if attention is not None:
            found.append(("attention", attention, None, layer_type))
        elif mixers:
            found.extend(("state", mixer, rule, layer_type) for mixer, rule in mixers)
        elif layer_type not in _STATE_FREE_TYPES:
            names = sorted({type(c).__name__ for c in block.children()})
            raise ValueError(
                f"PrefixFlow has no state rule for layer type {layer_type!r} (layer {i}: {names}); its "
                f"recurrent mixers with a rule: {list(RECURRENT_MIXERS)}"
            )
    if any(kind == "state" for kind, *_ in found):
        _check_hybrid_transformers()
    return found


def _check_hybrid_transformers() -> None:
    require_transformers(
        HYBRID_MIN_TRANSFORMERS,
        "hybrid (recurrent-state) models",
        "its recurrent mixers' state path is not verified there",
    )


def install_boundaries(
    config, blocks, state: AttentionState, attention_wrapper, rule_for=state_rule_for
) -> int:
    """Install PrefixFlow at every boundary: ``attention_wrapper(module, index)`` on attention layers, a
    :class:`StatefulLayer` on recurrent mixers. Returns the number of boundaries (their indices 0..n-1)."""
    layers = boundary_layers(config, blocks, rule_for)
    for index, (kind, module, rule, layer_type) in enumerate(layers):
        if kind == "attention":
            attention_wrapper(module, index)
        else:
            stateful = StatefulLayer(rule, index, state, layer_type)
            state.state_layers.append(stateful)
            install_state_layer(module, stateful)
    return len(layers)
