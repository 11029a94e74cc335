"""A TRL VLM micro-batch's multimodal inputs, per completion row, as PrefixFlow's ``prompt_inputs``.

TRL 1.16 hands ``training_step`` the processor's outputs for the whole micro-batch, as its
``_get_per_token_logps_and_entropies`` passes them to the model: image tensors concatenated over the rows
(``pixel_values`` patch rows split by ``image_grid_thw`` for Qwen-VL, one entry per image for Gemma-3),
``num_images`` per row, and per-token type ids over ``[prompt_ids || completion_ids]`` (left-padded prompt,
zeros over the completion). :func:`row_inputs` cuts them into each row's prompt alone (batch of one, unpadded),
named as the model names them, and refuses what PrefixFlow cannot train exactly, in one line naming TRL's field.
"""

from __future__ import annotations

import hashlib
import re

import torch

__all__ = ["TRAINED_VLM_TYPES", "row_inputs", "inputs_key", "refusal"]

# the vision-language model types PrefixFlowGRPOTrainer trains (checked against TRL's own step)
TRAINED_VLM_TYPES = ("qwen2_5_vl", "qwen3_vl", "gemma3")
_PER_TOKEN = ("mm_token_type_ids", "token_type_ids")
_TAKEN = ("pixel_values", "image_grid_thw", "num_images", *_PER_TOKEN)
# TRL's keys of families PrefixFlow's VLM adapter does not train (LFM2-VL, InternVL, Idefics, Gemma-4 ...)
_OTHER = ("pixel_attention_mask", "spatial_shapes", "num_tiles", "image_position_ids", "image_sizes")


def row_inputs(inputs: dict, placeholders: set[int]) -> list[dict] | None:
    """Per row of the micro-batch, its prompt's multimodal inputs (``[1, prompt tokens]`` type ids, that
    prompt's pixels and grids), or None for a text micro-batch. ``placeholders``: the model's image/video
    token ids (never inside a completion)."""
    if not any(inputs.get(k) is not None for k in (*_TAKEN, *_OTHER)):
        return None
    for key in _OTHER:
        if inputs.get(key) is not None:
            raise ValueError(
                f"TRL input {key!r} is not supported by PrefixFlowGRPOTrainer: it trains the vision-language "
                f"models {list(TRAINED_VLM_TYPES)}"
            )
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"].bool()
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"].bool()
    b, p = prompt_ids.shape
    held = torch.isin(completion_ids, torch.tensor(sorted(placeholders), device=completion_ids.device))
    held &= completion_mask
    if bool(held.any()):
        r, t = (int(i) for i in held.nonzero()[0])
        raise ValueError(
            f"completion_ids row {r} holds the image placeholder id {int(completion_ids[r, t])} (token {t}): images "
            "inside a completion (a tool's image response) are not supported; keep images in the prompt"
        )
    rows: list[dict] = [{} for _ in range(b)]
    for key in _PER_TOKEN:
        types = inputs.get(key)
        if types is None:
            continue
        if types.dim() != 2 or tuple(types.shape) != (b, p + completion_ids.shape[1]):
            raise ValueError(
                f"TRL input {key!r} has shape {tuple(types.shape)}; expected [{b}, prompt + completion tokens] = "
                f"[{b}, {p + completion_ids.shape[1]}]"
            )
        tail = types[:, p:] != 0
        if bool(tail.any()):
            r, t = (int(i) for i in tail.nonzero()[0])
            raise ValueError(
                f"TRL input {key!r} marks completion token {t} of row {r} as an image: images inside a completion "
                "(a tool's image response) are not supported; keep images in the prompt"
            )
        on_pad = (types[:, :p] != 0) & ~prompt_mask
        if bool(on_pad.any()):
            r = int(on_pad.nonzero()[0, 0])
            raise ValueError(
                f"TRL input {key!r} marks row {r}'s left padding as image tokens: the processor padded on the "
                "right while TRL left-pads prompt_ids; build processing_class's tokenizer with "
                "padding_side='left' (as TRL's from_pretrained does)"
            )
        for r in range(b):
            rows[r][key] = types[r, :p][prompt_mask[r]].unsqueeze(0)
    pixels = inputs.get("pixel_values")
    grids = inputs.get("image_grid_thw")
    counts = inputs.get("num_images")
    if pixels is None and grids is not None:
        raise ValueError(
            "TRL input 'image_grid_thw' comes without 'pixel_values'; pass the processor's whole output"
        )
    if pixels is not None:
        if counts is None:
            counts = [1] * b if grids is None and pixels.shape[0] == b else None
        if counts is None or len(counts) != b:
            raise ValueError(
                f"TRL input 'num_images' must list each of the {b} rows' image counts, got {counts!r}"
            )
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + int(n))
        if grids is not None:
            if grids.dim() != 2 or grids.shape[0] != starts[-1]:
                raise ValueError(
                    f"TRL input 'image_grid_thw' has shape {tuple(grids.shape)}; num_images {list(counts)} gives "
                    f"[{starts[-1]}, 3]"
                )
            patches = [0, *grids.long().prod(-1).cumsum(0).tolist()]
            if patches[-1] != pixels.shape[0]:
                raise ValueError(
                    f"TRL input 'pixel_values' has {pixels.shape[0]} patch rows; image_grid_thw {grids.tolist()} "
                    f"gives {patches[-1]}"
                )
        elif pixels.shape[0] != starts[-1]:
            raise ValueError(
                f"TRL input 'pixel_values' holds {pixels.shape[0]} images; num_images {list(counts)} gives "
                f"{starts[-1]}"
            )
        for r in range(b):
            lo, hi = starts[r], starts[r + 1]
            if lo == hi:
                continue
            if grids is None:
                rows[r]["pixel_values"] = pixels[lo:hi]
            else:
                rows[r]["pixel_values"] = pixels[patches[lo] : patches[hi]]
                rows[r]["image_grid_thw"] = grids[lo:hi]
    return rows


def inputs_key(inputs: dict | None) -> str:
    """A digest of one row's inputs (different images share placeholder ids; their rows must not share a group)."""
    if not inputs:
        return ""
    h = hashlib.sha256()
    for key in sorted(inputs):
        t = inputs[key].detach().contiguous().cpu()
        h.update(f"{key}{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.flatten().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def refusal(err: ValueError, rows: list[int]) -> ValueError:
    """A group's or tree's refusal in TRL's terms: its micro-batch rows, tree path ``i`` named as its row."""
    text = re.sub(r"path_inputs\[(\d+)\]", lambda m: f"row {rows[int(m[1])]}'s inputs", str(err))
    text = text.replace("prompt_inputs", "the prompt's inputs")
    return ValueError(f"TRL micro-batch rows {rows}: {text}")
