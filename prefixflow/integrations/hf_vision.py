"""Hugging Face vision-language models under PrefixFlow: images and video in the shared prompt.

A multimodal group carries its processor's extra outputs beside its token ids (``RolloutGroup.prompt_inputs``;
a tree: ``RolloutTree.path_inputs``). :class:`VisionLanguageAdapter` reads them per call
(:meth:`~VisionLanguageAdapter.prepare_inputs`, before any gradient changes) and per laid-out row
(:meth:`~VisionLanguageAdapter.rows_hidden`):

- the vision encoder runs for the images whose placeholder tokens a row holds, through the model's own
  ``get_image_features`` / ``get_video_features``, and the model's own forward merges its output into the
  embeddings (``mm_encoder_outputs``). A flat group's images sit in its cached prefix node, so PrefixFlow
  runs the tower once per group, in Phase A, and its backward once, in Phase C (none when the tower is
  frozen: it then runs under ``no_grad``); the baseline runs it once per full sequence;
- positions are the model's own: each path's full sequence ``[P || S_i]`` goes through the model's position
  function (``get_rope_index``) once per call, and every row reads its tokens' slice. The model's stored
  ``rope_deltas`` is never read;
- the model-family specifics (which keys, how an image's pixels and placeholder tokens are counted) are a
  :class:`~prefixflow.integrations.hf_vlm_families.Family`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from transformers import PreTrainedModel

from ..tree.masks import MaskRules
from .hf_configs import require_transformers
from .hf_vlm_families import Family, Prepared, QwenVL
from .hf_vlm_gemma import Gemma3
from .hf_vlm_llava import LlavaOnevision

FAMILIES: dict[str, Family] = {
    t: family for family in (QwenVL(), Gemma3(), LlavaOnevision()) for t in family.model_types
}
VLM_MODEL_TYPES = tuple(FAMILIES)
# The oldest transformers these families were checked exact on: on 5.17 (the lent GPU machine's) the losses
# differ from the full-sequence model's by 10-20% (docs/gpu.md), so older versions are refused.
VLM_MIN_TRANSFORMERS = "5.24.0"

__all__ = ["VLM_MODEL_TYPES", "VLM_MIN_TRANSFORMERS", "VisionLanguageMixin"]


def check_vlm_transformers() -> None:
    """Refuse vision-language models on a transformers older than :data:`VLM_MIN_TRANSFORMERS`, in one line."""
    require_transformers(
        VLM_MIN_TRANSFORMERS,
        "vision-language models",
        "their merged embeddings and positions are not verified there",
    )


class VisionLanguageMixin:
    """What :class:`~prefixflow.integrations.hf.VisionLanguageAdapter` adds to the HF adapter for
    ``*ForConditionalGeneration`` vision-language models (:data:`VLM_MODEL_TYPES`): the language model's
    decoder layers are the blocks; the vision tower runs inside the rows that hold images."""

    name = "hf-vlm"
    takes_inputs = True
    verified_types = VLM_MODEL_TYPES

    def matches(self, model: nn.Module) -> bool:
        language = getattr(getattr(model, "model", None), "language_model", None)
        return isinstance(model, PreTrainedModel) and hasattr(language, "layers")

    def blocks(self, model):
        return list(model.model.language_model.layers)

    def family(self, model):
        check_vlm_transformers()
        return FAMILIES[model.config.model_type]

    def hidden(self, model, tokens, positions, *, final_norm=True):
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        return self.family(model).text_forward(model, tokens, positions)

    def fsdp_units(self, model):
        raise ValueError("FSDP2 sharding of vision-language models is not available yet")

    def check(self, model, group) -> None:
        super().check(model, group)
        self.family(model).check_group(model, group)

    def prepare_inputs(self, model, tree) -> Prepared:
        return self.family(model).prepare(model, tree)

    def mask_rules(self, model, tree, inputs):
        """The language model's sliding windows, and the family's bidirectional spans (Gemma-3's images)."""
        rules = super().mask_rules(model, tree, inputs)
        blocks = None if inputs is None else self.family(model).blocks(inputs)
        if blocks is None or not any(blocks):
            return rules
        return MaskRules(rules.windows if rules else {}, blocks, inputs.path_of_node)

    def rows_hidden(self, model, mb, inputs: Prepared, *, final_norm=True):
        family = self.family(model)
        rows = mb.rows
        padded = mb.tokens.shape[0] == len(rows)
        device = mb.tokens.device
        ids = mb.tokens.clone()
        width = ids.shape[1]
        pos = torch.zeros(family.dims, ids.shape[0], width, dtype=torch.long, device=device)
        per_kind: dict[str, list] = {}
        offset = 0
        for b, row in enumerate(rows):
            path = row.path if row.path >= 0 else inputs.path_of_node[row.nodes[0]]
            start, n = row.first_position, len(row)
            at = (b, slice(0, n)) if padded else (0, slice(offset, offset + n))
            pos[:, at[0], at[1]] = inputs.positions[path][:, start : start + n]
            if padded and n < width:
                ids[b, n:] = inputs.pad_id  # pads are never read; they must not count as placeholders
            items = [it for it in inputs.items[path] if start <= it.start < start + n]
            for it in items:
                per_kind.setdefault(it.kind, []).append(it)
            if items:
                inputs.counts["runs"] += 1
            offset += n
        encoded = {kind: self._encode(model, family, kind, items, inputs) for kind, items in per_kind.items()}
        return family.forward(model, ids, pos, encoded)

    def _encode(self, model, family, kind: str, items: list, inputs: Prepared):
        """The vision tower on ``items`` (images or videos, in placeholder order), counted; under ``no_grad``
        when no tower parameter trains (a frozen tower keeps no activations and has no backward)."""
        trains = any(p.requires_grad for m in family.encoder_modules(model) for p in m.parameters())
        with (
            torch.set_grad_enabled(torch.is_grad_enabled() and trains),
            FlopCounterMode(display=False) as flops,
        ):
            out = family.encode(model, kind, items)
        inputs.counts["tokens"] += sum(it.patches for it in items)
        inputs.counts["flops"] += int(flops.get_total_flops())
        return out
