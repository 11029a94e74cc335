"""Model adapters: what the schedule needs from a model family, and nothing else.

The three phases never reach into a model's modules. They ask the model's :class:`ModelAdapter` for:

- ``hidden(model, tokens, positions)``: the forward without the LM head (embeddings, blocks, final norm),
  with token positions given explicitly (``None`` = ``0 .. L-1``);
- ``lm_head(model)``: the module that maps hidden states to logits (run only at loss positions);
- ``vocab_size`` / ``max_seq_len``: what validation checks a group against;
- ``blocks(model)`` and ``block_is_checkpointed``: the decoder blocks, in order;
- ``wrap_attention(model, state)``: install :class:`~prefixflow.attention.PrefixAwareAttention` at each
  layer's attention boundary, after RoPE, so the schedule's attention modes see post-RoPE ``[B, H, L, D]``
  q/k/v; and, for a recurrent token mixer (gated DeltaNet, Mamba-2), a
  :class:`~prefixflow.state.layers.StatefulLayer` running the layer's state rule;
- ``state_rule(module)``: the per-layer-type state cache hook: how a recurrent mixer carries its prefix
  boundary as a state (:class:`~prefixflow.state.layers.StateRule`), or None for a module that has none;
- ``fsdp_units(model)``: the FSDP2 sharding units (embedding, each block, final norm + LM head; a tied
  embedding and LM head share one unit), which :func:`prefixflow.parallel.fsdp.apply_fsdp` shards.

:class:`TorchTitanAdapter` lives here. Integrations (``prefixflow.integrations.hf``) register their own with
:func:`register_adapter`; the core never imports them. An installed integration may also announce itself
through the ``prefixflow.model.adapters`` entry-point group, which :func:`adapter_for` loads the first time a model
matches no registered adapter.
"""

from __future__ import annotations

from importlib import metadata

import torch
from torch import nn

from ..attention.modes import AttentionState, PrefixAwareAttention
from ..runtime import HANDLE, runtime_of, unwrapped
from ..state.layers import StateRule, state_rule_for
from .models import rope_buffer

__all__ = ["ModelAdapter", "TorchTitanAdapter", "register_adapter", "adapter_for", "ENTRY_POINT_GROUP"]

ENTRY_POINT_GROUP = "prefixflow.adapters"


class ModelAdapter:
    """The interface between a model family and the schedule. Subclass it for a new family."""

    name = "model"

    def matches(self, model: nn.Module) -> bool:
        """Whether this adapter handles ``model``."""
        raise NotImplementedError

    def hidden(
        self,
        model: nn.Module,
        tokens: torch.Tensor,
        positions: torch.Tensor | None,
        *,
        final_norm: bool = True,
    ) -> torch.Tensor:
        """Hidden states ``[b, L, D]`` of ``tokens[b, L]`` at ``positions[1 or b, L]`` (None = ``0..L-1``).
        ``final_norm=False`` allows skipping the final norm (Phase A never reads its output)."""
        raise NotImplementedError

    def lm_head(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError

    def vocab_size(self, model: nn.Module) -> int:
        raise NotImplementedError

    def max_seq_len(self, model: nn.Module) -> int:
        raise NotImplementedError

    #: Whether the family takes multimodal inputs (``RolloutGroup.prompt_inputs``, ``RolloutTree.path_inputs``).
    takes_inputs = False

    #: The config field that bounds the sequence length, named in the error for a too-long sequence.
    max_seq_len_field = "max_seq_len"

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        raise NotImplementedError

    def block_is_checkpointed(self, block: nn.Module) -> bool:
        """True when ``block`` recomputes its forward in the backward (activation checkpointing)."""
        return False

    def wrap_attention(self, model: nn.Module, state: AttentionState) -> int:
        """Route every layer's attention through a ``PrefixAwareAttention`` sharing ``state``; return the
        number of layers wrapped. Raise ``ValueError`` (naming the fix) for an attention it cannot wrap."""
        raise NotImplementedError

    def state_rule(self, module: nn.Module) -> StateRule | None:
        """The state rule of a recurrent token mixer (its prefix boundary is ``(state, conv tail)``, cached in
        ``PrefixKVCache.states``), or None. Default: the rules registered per module class
        (:func:`~prefixflow.state.layers.register_state_rule`). A family without recurrent layers needs none."""
        return state_rule_for(module)

    def check(self, model: nn.Module, group) -> None:
        """Family-specific validation of a group before any gradient changes (default: none)."""
        return None

    def prepare_inputs(self, model: nn.Module, tree) -> object:
        """The per-call state of a tree with ``path_inputs`` (multimodal prompts): whatever
        :meth:`rows_hidden` reads. Raise ``ValueError`` naming the field for inputs the model cannot take,
        before any gradient changes. Default: a family without multimodal inputs refuses them."""
        raise ValueError(
            f"prompt_inputs / path_inputs carry multimodal inputs; {type(model).__name__} ({self.name} adapter) "
            "takes none: drop them, or use a vision-language model (docs/multimodal.md)"
        )

    def mask_rules(self, model: nn.Module, tree, inputs: object):
        """Attention beyond causal for this call (a :class:`~prefixflow.tree.masks.MaskRules`: sliding windows
        that the tree's paths outgrow, bidirectional spans), or None (default: plain causal)."""
        return None

    def rows_hidden(self, model: nn.Module, mb, inputs: object, *, final_norm: bool = True) -> torch.Tensor:
        """Hidden states of a laid-out microbatch ``mb`` (a :class:`~prefixflow.tree.layouts.Microbatch`;
        ``mb.rows`` says which tokens of which path each row holds) with ``inputs`` = what
        :meth:`prepare_inputs` returned for the call. Multimodal families override it; by default the rows
        need nothing beyond their tokens and positions."""
        return self.hidden(model, mb.tokens, mb.positions, final_norm=final_norm)

    def apply_ac(self, model: nn.Module, mode: str) -> None:
        """Activation checkpointing ``"selective"`` or ``"full"`` on every block, in place."""
        raise ValueError(f"apply_ac is not available for {self.name} models")

    def fsdp_units(self, model: nn.Module) -> list[tuple[str, nn.Module | list[nn.Module]]]:
        """FSDP2 units ``(name, module or modules)`` in forward order: the input embedding, each block of
        :meth:`blocks` (each its own unit), then everything after the blocks (final norm, LM head) as one
        unit, outermost last; a tied embedding joins the last unit. Every parameter must be in one unit:
        PrefixFlow runs the model piecewise, never through the root's forward."""
        raise ValueError(f"FSDP2 sharding is not available for {self.name} models")


class TorchTitanAdapter(ModelAdapter):
    """TorchTitan decoders (llama3, qwen3): ``tok_embeddings``, ``layers``, ``norm``, ``output``, a RoPE buffer.
    The cut is each attention module's ``inner_attention`` (TorchTitan's SDPA wrapper)."""

    name = "torchtitan"

    def matches(self, model: nn.Module) -> bool:
        return all(hasattr(model, a) for a in ("model_args", "layers", "tok_embeddings", "output"))

    def hidden(self, model, tokens, positions, *, final_norm=True):
        # A pipeline stage (TorchTitan's split) lacks the embedding before its first stage (its input is the
        # previous stage's hidden states) and the final norm after its last.
        h = model.tok_embeddings(tokens) if model.tok_embeddings is not None else tokens
        rope = rope_buffer(model)
        if positions is None and runtime_of(model, create=True).tp:
            # Under TP the blocks see padded sequence shards; explicit positions tell them the real length, and
            # as a block input they reach an activation-checkpoint recompute whatever offload did to ``h``.
            positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        for block in model.layers.values():
            h = block(h, rope, None, positions)
        return model.norm(h) if final_norm and model.norm is not None else h

    def lm_head(self, model):
        return model.output

    def vocab_size(self, model):
        return int(model.model_args.vocab_size)

    def max_seq_len(self, model):
        return int(model.model_args.max_seq_len)

    def blocks(self, model):
        return list(model.layers.values())

    def block_is_checkpointed(self, block):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

        return isinstance(block, CheckpointWrapper)

    def wrap_attention(self, model, state):
        from torchtitan.models.attention import ScaledDotProductAttentionWrapper

        n = 0
        for block in model.layers.values():
            attention = next((m for m in block.modules() if hasattr(m, "inner_attention")), None)
            if attention is None or not isinstance(
                attention.inner_attention, ScaledDotProductAttentionWrapper
            ):
                kind = None if attention is None else type(attention.inner_attention).__name__
                raise ValueError(
                    f"PrefixFlow wraps TorchTitan's SDPA attention; this model uses {kind}. "
                    "Build it with attn_type='sdpa' (overrides={'attn_type': 'sdpa'})."
                )
            attention.inner_attention = PrefixAwareAttention(attention.inner_attention, n, state)
            n += 1
        return n

    def fsdp_units(self, model):
        # TorchTitan's apply_fsdp units; a pipeline stage lacks the embedding, the head or both (None)
        tok, norm, out = model.tok_embeddings, model.norm, model.output
        tied = tok is not None and out is not None and out.weight is tok.weight
        units: list[tuple[str, nn.Module | list[nn.Module]]] = []
        if tok is not None and not tied:
            units.append(("tok_embeddings", tok))
        units += [(f"layers.{name}", block) for name, block in model.layers.items()]
        named = [("tok_embeddings", tok)] if tied else []
        named += [(n, m) for n, m in (("norm", norm), ("output", out)) if m is not None]
        if named:
            units.append(("+".join(n for n, _ in named), [m for _, m in named]))
        return units

    def apply_ac(self, model, mode):
        from torchtitan.config.job_config import ActivationCheckpoint
        from torchtitan.distributed.activation_checkpoint import apply_ac as titan_apply_ac
        from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list

        if any(self.block_is_checkpointed(block) for block in self.blocks(model)):
            raise ValueError("activation checkpointing is already applied to this model")
        if mode == "selective":
            config = ActivationCheckpoint(mode="selective", selective_ac_option="op")
        else:
            config = ActivationCheckpoint(mode="full")
        titan_apply_ac(model, config, op_sac_save_list=_op_sac_save_list)


_ADAPTERS: list[ModelAdapter] = [TorchTitanAdapter()]
_entry_points_loaded = False


def register_adapter(adapter: ModelAdapter) -> ModelAdapter:
    """Add ``adapter`` to the registry (idempotent per adapter class). Returns it."""
    if not isinstance(adapter, ModelAdapter):
        raise TypeError(
            f"adapter must be a prefixflow.model.adapters.ModelAdapter, got {type(adapter).__name__}"
        )
    if not any(type(a) is type(adapter) for a in _ADAPTERS):
        _ADAPTERS.append(adapter)
    return adapter


def _load_entry_points() -> None:
    """Import the integrations installed packages announce (each registers its adapter on import)."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry.load()
        except ImportError:
            continue  # the integration's optional dependencies are not installed


def adapter_for(model: nn.Module) -> ModelAdapter:
    """The adapter of ``model``: the one ``apply_prefixflow`` chose, else the first registered one that
    matches. Raises ``TypeError`` naming the supported families."""
    runtime = unwrapped(model).__dict__.get(HANDLE)
    if runtime is not None and runtime.adapter is not None:
        return runtime.adapter
    for attempt in range(2):
        for adapter in _ADAPTERS:
            if adapter.matches(model):
                return adapter
        if attempt == 0:
            _load_entry_points()
    names = [a.name for a in _ADAPTERS]
    raise TypeError(
        f"{type(model).__name__} is not a model PrefixFlow knows (adapters: {names}). For Hugging Face "
        "transformers models, install prefixflow[hf] and `import prefixflow.integrations.hf`."
    )
