"""What a placeholder token stands for: the content keys ``build_tree`` compares beside token ids.

Different images use the same placeholder ids, so two paths may share a token only if it stands for the same
image. :func:`content_keys` gives every token of every path a key: None for text, and for a multimodal
placeholder a digest of its image's own inputs (pixels and grid), so equal images in two paths share, and
different images split the tree right before them. The processor's token-aligned type ids
(``mm_token_type_ids`` for Qwen-VL, ``token_type_ids`` for Gemma-3) say which tokens are placeholders; each
contiguous run of one type is one image (a Qwen-VL video, whose frames may sit in several runs, is matched to
its runs by token count). Inputs without type ids (e.g. LLaVA-OneVision's) are compared whole: their paths
share tokens only where all their inputs are equal.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["content_keys"]

_TYPE_KEYS = ("mm_token_type_ids", "token_type_ids")
_NOT_CONTENT = ("attention_mask", *_TYPE_KEYS)


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _runs(types: list[int]) -> list[tuple[int, int, int]]:
    """``(type, start, end)`` of every contiguous run of a non-zero type."""
    out, start = [], None
    for t, v in enumerate([*types, 0]):
        if start is not None and v != types[start]:
            out.append((types[start], start, t))
            start = None
        if start is None and v != 0 and t < len(types):
            start = t
    return out


def _per_item(inputs: dict, kind: int, runs: list[tuple[int, int]]) -> list[str] | None:
    """One digest per run of placeholder type ``kind``, or None when the inputs do not split into items."""
    qwen = {1: ("pixel_values", "image_grid_thw"), 2: ("pixel_values_videos", "video_grid_thw")}
    if "image_grid_thw" in inputs or "video_grid_thw" in inputs:  # Qwen-VL: patch rows per (t, h, w) grid
        pix_key, grid_key = qwen[kind]
        pixels, grids = inputs.get(pix_key), inputs.get(grid_key)
        if pixels is None or grids is None:
            return None
        patches = grids.long().prod(-1).tolist()
        tokens = sum(e - s for s, e in runs)
        if not tokens or sum(patches) % tokens:
            return None
        ratio = sum(patches) // tokens  # patches per placeholder token (spatial merge squared)
        digests, row, k = [], 0, 0
        for g, n in enumerate(patches):
            item = _digest(pixels[row : row + n], grids[g])
            row += n
            want, got = n // ratio, 0
            while got < want and k < len(runs):
                got += runs[k][1] - runs[k][0]
                digests.append(item)
                k += 1
            if got != want:
                return None
        return digests if k == len(runs) else None
    pixels = inputs.get("pixel_values")  # one image per run (Gemma-3)
    if kind != 1 or pixels is None or pixels.shape[0] != len(runs):
        return None
    return [_digest(pixels[k]) for k in range(len(runs))]


def content_keys(seqs: list[torch.Tensor], path_inputs: list[dict | None] | None) -> list[list] | None:
    """Per sequence, per token: None (text) or the digest of the image its placeholder stands for; a path
    whose inputs do not split into items keys every token with the digest of all its inputs."""
    if path_inputs is None or all(x is None for x in path_inputs):
        return None
    out = []
    for seq, inputs in zip(seqs, path_inputs, strict=True):
        n = int(seq.numel())
        keys: list = [None] * n
        if not inputs:
            out.append(keys)
            continue
        type_key = next((k for k in _TYPE_KEYS if k in inputs), None)
        split = None
        if type_key is not None:
            types = inputs[type_key].reshape(-1)[:n].tolist()
            runs = _runs(types)
            split = {}
            for kind in sorted({r[0] for r in runs}):
                mine = [(s, e) for k, s, e in runs if k == kind]
                digests = _per_item(inputs, kind, mine)
                if digests is None:
                    split = None
                    break
                for (s, e), d in zip(mine, digests, strict=True):
                    keys[s:e] = [d] * (e - s)
        if split is None:
            whole = _digest(*[inputs[k] for k in sorted(inputs) if k not in _NOT_CONTENT])
            keys = [whole] * n
        out.append(keys)
    return out
