"""LLaVA-OneVision (``LlavaOnevisionForConditionalGeneration``): a SigLIP tower over the image's anyres tiles,
the projector, and the model's own packing (base tile, unpadded tiles, a newline per row). 1-D positions,
causal attention. How many tokens each image takes is the model's own ``pack_image_features`` run on
feature-sized zeros (no tower), so a prompt that disagrees is refused before any work."""

from __future__ import annotations

import torch

from .hf_vlm_families import EncoderOutputsFamily, Item

__all__ = ["LlavaOnevision"]


class LlavaOnevision(EncoderOutputsFamily):
    """Images: ``pixel_values`` ``[images, tiles, channels, size, size]`` and ``image_sizes`` ``[images, 2]``
    (``batch_num_images`` when the processor gives it: an image of a multi-image prompt is not tiled)."""

    model_types = ("llava_onevision",)
    keys = ("pixel_values", "image_sizes", "batch_num_images", "attention_mask")

    def placeholder_ids(self, model):
        return {int(model.config.image_token_id), int(model.config.video_token_id)}

    def encode(self, model, kind, items):
        counts = [it.extra["images"] for it in items]
        return model.model.get_image_features(
            torch.stack([it.pixels for it in items]), torch.stack([it.grid for it in items]),
            batch_num_images=_groups(counts), return_dict=True,
        )  # fmt: skip

    def _tokens_per_image(self, model, sizes: torch.Tensor, tiled: list[bool]) -> list[int]:
        return self._layout(model, sizes, tiled)[0]

    def _layout(self, model, sizes: torch.Tensor, tiled: list[bool]) -> tuple[list[int], list[int]]:
        """``(placeholder tokens, tiles the tower encodes)`` per image, by the model's own functions."""
        from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

        config = model.config
        side = config.vision_config.image_size // config.vision_config.patch_size
        feats, tiles = [], []
        for size, tile in zip(sizes, tiled, strict=True):
            n = image_size_to_num_patches(size, config.image_grid_pinpoints, config.vision_config.image_size)
            tiles.append(n if tile else 1)
            feats.append(torch.zeros(tiles[-1], side * side, 1))
        _, lens = model.model.pack_image_features(
            feats, sizes, image_newline=torch.zeros(1), vision_aspect_ratio=config.vision_aspect_ratio
        )
        return lens.tolist(), tiles

    def path(self, model, tokens, inputs, name, prompt_len, index):
        config = model.config
        inputs = inputs or {}
        image_id = int(config.image_token_id)
        n = tokens.numel()
        positions = torch.arange(n, device=tokens.device).view(1, -1)
        holds = tokens == image_id
        if bool((tokens == int(config.video_token_id)).any()):
            raise ValueError(
                f"path {index} holds video tokens; LLaVA-OneVision video prompts are not supported yet"
            )
        pixels, sizes = inputs.get("pixel_values"), inputs.get("image_sizes")
        if not bool(holds.any()) and pixels is None:
            return positions, []
        if prompt_len is not None and bool(holds[prompt_len:].any()):
            t = int(holds[prompt_len:].nonzero()[0])
            raise ValueError(
                f"responses[{index}] holds the image token id {image_id} (token {t}): images inside a response "
                "are not supported; put them in the prompt"
            )
        for key, value in (("pixel_values", pixels), ("image_sizes", sizes)):
            if value is None:
                raise ValueError(
                    f"{name} has no {key!r} for the {int(holds.sum())} image tokens of its sequence"
                )
        size = int(config.vision_config.image_size)
        if pixels.dim() != 5 or tuple(pixels.shape[2:]) != (
            int(config.vision_config.num_channels),
            size,
            size,
        ):
            raise ValueError(f"{name}['pixel_values'] must be [images, tiles, channels, {size}, {size}], got "
                             f"{tuple(pixels.shape)}")  # fmt: skip
        if sizes.dim() != 2 or tuple(sizes.shape) != (pixels.shape[0], 2):
            raise ValueError(f"{name}['image_sizes'] must be [{pixels.shape[0]}, 2] (one (h, w) per image), got "
                             f"{tuple(sizes.shape)}")  # fmt: skip
        per_sample = inputs.get("batch_num_images")
        count = pixels.shape[0]
        if per_sample is not None and per_sample.reshape(-1).tolist() != [count]:
            raise ValueError(
                f"{name}['batch_num_images'] = {per_sample.tolist()}; a prompt alone has [{count}]"
            )
        tiled = [count == 1 or per_sample is None] * count
        lens, tiles = self._layout(model, sizes.cpu(), tiled)
        if max(tiles) > pixels.shape[1]:
            raise ValueError(
                f"{name}['pixel_values'] has {pixels.shape[1]} tiles per image; image_sizes {sizes.tolist()} need "
                f"{max(tiles)} (image_grid_pinpoints)"
            )
        where = holds.nonzero().flatten().tolist()
        if len(where) != sum(lens):
            raise ValueError(
                f"the prompt has {len(where)} image tokens; {name}['pixel_values'] and ['image_sizes'] "
                f"{sizes.tolist()} give {sum(lens)} ({lens} per image)"
            )
        items, at = [], 0
        for k, length in enumerate(lens):
            span = where[at : at + length]
            if span[-1] - span[0] + 1 != length:
                raise ValueError(f"{name}: image {k}'s {length} placeholder tokens are not contiguous")
            patches = tiles[k] * (size // int(config.vision_config.patch_size)) ** 2
            images = count if per_sample is not None else 1
            items.append(
                Item("image", span[0], span[-1] + 1, pixels[k], sizes[k], patches, {"images": images})
            )
            at += length
        return positions, items


def _groups(counts: list[int]) -> list[int] | None:
    """``batch_num_images`` for images of samples with ``counts`` images each, in order (None: each alone)."""
    if all(c == 1 for c in counts):
        return None
    out, k = [], 0
    while k < len(counts):
        out.append(counts[k])
        k += counts[k]
    return out
