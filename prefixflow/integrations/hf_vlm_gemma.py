"""Gemma-3 with its vision tower (``Gemma3ForConditionalGeneration``): SigLIP patches pooled to
``mm_tokens_per_image`` soft tokens per image, 1-D positions, and image tokens that attend to each other both
ways when ``token_type_ids`` is given (the model's own forward does so; here the rows' masks do,
:class:`~prefixflow.tree.masks.MaskRules`)."""

from __future__ import annotations

import torch

from .hf_vlm_families import EncoderOutputsFamily, Item, _runs

__all__ = ["Gemma3"]


class Gemma3(EncoderOutputsFamily):
    """``pixel_values``: ``[images, channels, size, size]``; ``token_type_ids``: 1 on image tokens (required:
    without it the model's image tokens attend causally, which the processor never asks for)."""

    model_types = ("gemma3",)
    keys = ("pixel_values", "token_type_ids", "attention_mask")

    def placeholder_ids(self, model):
        return {int(model.config.image_token_id)}

    def encode(self, model, kind, items):
        return model.model.get_image_features(torch.stack([it.pixels for it in items]), return_dict=True)

    def blocks(self, prepared):
        return [[(it.start, it.end) for it in items] for items in prepared.items]

    def path(self, model, tokens, inputs, name, prompt_len, index):
        config = model.config
        inputs = inputs or {}
        image_id, per_image = int(config.image_token_id), int(config.mm_tokens_per_image)
        n = tokens.numel()
        positions = torch.arange(n, device=tokens.device).view(1, -1)
        holds = tokens == image_id
        pixels = inputs.get("pixel_values")
        if not bool(holds.any()) and pixels is None:
            return positions, []
        if prompt_len is not None and bool(holds[prompt_len:].any()):
            t = int(holds[prompt_len:].nonzero()[0])
            raise ValueError(
                f"responses[{index}] holds the image token id {image_id} (token {t}): images inside a response "
                "are not supported; put them in the prompt"
            )
        if pixels is None:
            raise ValueError(
                f"{name} has no 'pixel_values' for the {int(holds.sum())} image tokens of its sequence"
            )
        types_in = inputs.get("token_type_ids")
        if types_in is None:
            raise ValueError(
                f"{name} has no 'token_type_ids' (1 on image tokens): Gemma-3's image tokens attend to each other "
                "both ways only with it; pass the processor's output"
            )
        if types_in.dim() != 2 or types_in.shape[0] != 1 or types_in.shape[1] > n:
            raise ValueError(
                f"{name}['token_type_ids'] has shape {tuple(types_in.shape)}; expected [1, prompt tokens]"
            )
        covered = types_in.shape[1]
        types = torch.zeros(n, dtype=torch.long, device=tokens.device)
        types[:covered] = types_in[0].to(tokens.device).long()
        if bool(holds[covered:].any()):
            t = int(holds[covered:].nonzero()[0]) + covered
            raise ValueError(
                f"path {index} holds the image token id at token {t}, past what {name}['token_type_ids'] covers"
            )
        if not bool(((types == 1) == holds).all()):
            t = int(((types == 1) != holds).nonzero()[0])
            raise ValueError(
                f"{name}['token_type_ids'] marks token {t} as {'' if types[t] == 1 else 'not '}image, but its token "
                f"id is {int(tokens[t])} (image token id: {image_id})"
            )
        size = int(config.vision_config.image_size)
        want = (int(config.vision_config.num_channels), size, size)
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != want:
            raise ValueError(
                f"{name}['pixel_values'] must be [images, {', '.join(map(str, want))}], got {tuple(pixels.shape)}"
            )
        runs = _runs(types.tolist(), 1)
        if sum(e - s for s, e in runs) != pixels.shape[0] * per_image or any(
            e - s != per_image for s, e in runs
        ):
            raise ValueError(
                f"the prompt has {int(holds.sum())} image tokens in {len(runs)} runs; {name}['pixel_values'] holds "
                f"{pixels.shape[0]} images of mm_tokens_per_image={per_image} each"
            )
        patches = (size // int(config.vision_config.patch_size)) ** 2
        grid = torch.tensor([1, per_image, 1])
        items = [Item("image", s, e, pixels[k], grid, patches) for k, (s, e) in enumerate(runs)]
        return positions, items
