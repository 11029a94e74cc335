"""What differs between vision-language families: their processor keys, how an image's pixels and placeholder
tokens are counted, their position function and how their forward takes encoded images.

:class:`Prepared` is one call's state (each path's positions and images, the counters); a :class:`Family`
checks a tree's ``path_inputs`` and builds it (one-line ``ValueError`` naming the field, before any gradient
changes). :class:`QwenVL` covers Qwen2.5-VL and Qwen3-VL (mRoPE, 3-D positions; Qwen3-VL's deepstack
features ride along with the encoder output).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["Item", "Prepared", "Family", "EncoderOutputsFamily", "QwenVL"]


@dataclass
class Item:
    """One image or video of a path: its placeholder tokens ``[start, end)`` and what the tower reads."""

    kind: str  # "image" or "video"
    start: int
    end: int
    pixels: torch.Tensor
    grid: torch.Tensor
    patches: int  # the tower's input tokens
    extra: dict = field(default_factory=dict)


@dataclass
class Prepared:
    """One call's multimodal state: per path its positions (``[3, L]`` for mRoPE) and images, a path through
    each node (its rows read that path's slice), the pad id, and the tower counters GroupStats reports."""

    positions: list[torch.Tensor]
    items: list[list[Item]]
    path_of_node: dict[int, int]
    pad_id: int
    counts: dict[str, int] = field(default_factory=lambda: {"tokens": 0, "flops": 0, "runs": 0})


def _runs(types: list[int], value: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` runs where ``types`` equals ``value``."""
    out, start = [], None
    for t, v in enumerate([*types, None]):
        if v == value and start is None:
            start = t
        elif v != value and start is not None:
            out.append((start, t))
            start = None
    return out


def path_inputs_of(group) -> tuple[list, list[torch.Tensor], str]:
    """``(path inputs, path tokens, how to name path i)`` of a RolloutGroup or RolloutTree."""
    if hasattr(group, "prompt_inputs"):
        tokens = [torch.cat([group.prompt, r]) for r in group.responses]
        return [group.prompt_inputs] * group.n, tokens, "group"
    tokens = [group.path_tokens(i) for i in range(group.n)]
    return list(group.path_inputs or [None] * group.n), tokens, "tree"


class Family:
    """A vision-language family. Subclasses name their ``keys`` and implement the hooks below."""

    model_types: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()
    dims = 3  # position ids per token (mRoPE: t, h, w)

    def encoder_modules(self, model) -> list[nn.Module]:
        """The modules the vision encoding runs (tower, projector): frozen together, it runs under no_grad."""
        raise NotImplementedError

    def blocks(self, prepared: Prepared) -> list[list[tuple[int, int]]] | None:
        """Per path, the token spans that attend to each other both ways (None: causal throughout)."""
        return None

    def text_forward(self, model, tokens, positions) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, model, ids, positions, encoded: dict) -> torch.Tensor:
        raise NotImplementedError

    def encode(self, model, kind: str, items: list[Item]):
        raise NotImplementedError

    def path(self, model, tokens: torch.Tensor, inputs: dict | None, name: str, prompt_len, index: int):
        """``(positions, items)`` of path ``index``'s full token sequence (the model's own position function);
        ``prompt_len``: a group's (its responses follow), None for a tree path."""
        raise NotImplementedError

    def placeholder_ids(self, model) -> set[int]:
        raise NotImplementedError

    def check_group(self, model, group) -> None:
        self.prepare(model, group)

    def prepare(self, model, group) -> Prepared:
        path_inputs, tokens, kind = path_inputs_of(group)
        prompt_len = group.prompt_len if kind == "group" else None
        positions, items = [], []
        for i, (inputs, seq) in enumerate(zip(path_inputs, tokens, strict=True)):
            self._check_keys(model, inputs, kind, i)
            name = "prompt_inputs" if kind == "group" else f"path_inputs[{i}]"
            pos, its = self.path(model, seq, inputs, name, prompt_len, i)
            positions.append(pos)
            items.append(its)
        path_of_node: dict[int, int] = {}
        if kind == "tree":
            for i in range(group.n):
                for j in group.path_nodes(i):
                    path_of_node.setdefault(j, i)
            cuts = [{group.first_position[j] for j in group.path_nodes(i)} for i in range(group.n)]
        else:  # the cached node is P[:-1]: each leaf runs the prompt's last token again
            cuts = [{group.prompt_len - 1}] * group.n
        self._check_cuts(kind, cuts, items)
        placeholders = self.placeholder_ids(model)
        pad = next(t for t in range(len(placeholders) + 1) if t not in placeholders)
        return Prepared(positions, items, path_of_node, pad)

    def keys_of(self, model) -> tuple[str, ...]:
        """The processor keys this model takes."""
        return self.keys

    def _check_keys(self, model, inputs, kind, i) -> None:
        name = "prompt_inputs" if kind == "group" else f"path_inputs[{i}]"
        keys = self.keys_of(model)
        for key in inputs or {}:
            if key not in keys:
                raise ValueError(
                    f"{name}[{key!r}] is not an input of {type(model).__name__}; its processor keys: "
                    f"{list(keys)} (input_ids travel as the group's token ids)"
                )
        mask = (inputs or {}).get("attention_mask")
        if mask is not None and not bool((mask != 0).all()):
            raise ValueError(
                f"{name}['attention_mask'] masks tokens; pass the prompt unpadded (batch of one)"
            )

    def _check_cuts(self, kind, cuts, items) -> None:
        """No node boundary may cut an image's placeholder run (its features merge into one node's row)."""
        for i, its in enumerate(items):
            for it in its:
                inside = sorted(c for c in cuts[i] if it.start < c < it.end)
                if inside and kind == "group":
                    raise ValueError(
                        f"prompt ends inside its {it.kind} (its last token is a placeholder); end the prompt "
                        "with text after the image (e.g. the vision end token)"
                    )
                if inside:
                    raise ValueError(
                        f"path_inputs[{i}]: a tree node starts at token {inside[0]}, inside the {it.kind} at "
                        f"tokens [{it.start}, {it.end}); build the tree with build_tree(..., path_inputs=...)"
                    )


def _text_positions(n: int, device) -> torch.Tensor:
    return torch.arange(n, device=device).view(1, -1).expand(3, -1)


class EncoderOutputsFamily(Family):
    """A family with 1-D positions whose base model takes the encoded images as ``mm_encoder_outputs``
    (Gemma-3, LLaVA-OneVision): the tower and projector are its encoder."""

    dims = 1

    def encoder_modules(self, model):
        return [model.model.vision_tower, model.model.multi_modal_projector]

    def text_forward(self, model, tokens, positions):
        return model.model(input_ids=tokens, position_ids=positions, use_cache=False).last_hidden_state

    def forward(self, model, ids, positions, encoded):
        out = model.model(
            input_ids=ids,
            position_ids=positions[0],
            mm_encoder_outputs=dict(encoded) or None,
            use_cache=False,
        )
        return out.last_hidden_state


class QwenVL(Family):
    """Qwen2.5-VL and Qwen3-VL: ``pixel_values`` / ``pixel_values_videos`` are patch rows, ``*_grid_thw`` each
    image's (t, h, w) patches, ``mm_token_type_ids`` 1 on image and 2 on video placeholder tokens (without it
    Qwen2.5-VL silently falls back to 1-D positions, so it is required)."""

    model_types = ("qwen2_5_vl", "qwen3_vl")
    keys = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "mm_token_type_ids",
            "second_per_grid_ts", "attention_mask")  # fmt: skip
    _KINDS = (
        ("image", 1, "pixel_values", "image_grid_thw"),
        ("video", 2, "pixel_values_videos", "video_grid_thw"),
    )

    def encoder_modules(self, model):
        return [model.model.visual]

    def keys_of(self, model):
        if model.config.model_type == "qwen2_5_vl":
            return self.keys
        return tuple(k for k in self.keys if k != "second_per_grid_ts")  # Qwen3-VL: timestamps are tokens

    def placeholder_ids(self, model):
        c = model.config
        return {c.image_token_id, c.video_token_id}

    def text_forward(self, model, tokens, positions):
        return model.model(input_ids=tokens, position_ids=positions, use_cache=False).last_hidden_state

    def encode(self, model, kind, items):
        pixels = torch.cat([it.pixels for it in items])
        grid = torch.stack([it.grid for it in items])
        get = model.model.get_image_features if kind == "image" else model.model.get_video_features
        return get(pixels, grid, return_dict=True)

    def forward(self, model, ids, positions, encoded):
        out = model.model(
            input_ids=ids, position_ids=positions, mm_encoder_outputs=dict(encoded) or None, use_cache=False
        )
        return out.last_hidden_state

    def path(self, model, tokens, inputs, name, prompt_len, index):
        config = model.config
        inputs = inputs or {}
        ids = {1: config.image_token_id, 2: config.video_token_id}
        n = tokens.numel()
        for value, token in ids.items():
            if prompt_len is not None and bool((tokens[prompt_len:] == token).any()):
                t = int((tokens[prompt_len:] == token).nonzero()[0])
                kind = "image" if value == 1 else "video"
                raise ValueError(
                    f"responses[{index}] holds the {kind} placeholder id {token} (token {t}): images inside a "
                    "response are not supported; put them in the prompt"
                )
        present = {k: bool((tokens == ids[k]).any()) for k in ids}
        vision = config.vision_config
        merge = vision.spatial_merge_size
        width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        if not any(present.values()) and not any(k in inputs for _, _, k, _ in self._KINDS):
            return _text_positions(n, tokens.device), []
        for kind, value, pix_key, _ in self._KINDS:
            if present[value] and pix_key not in inputs:
                held = int((tokens == ids[value]).sum())
                raise ValueError(f"{name} has no {pix_key!r} for the {held} {kind} tokens of its sequence")
        types_in = inputs.get("mm_token_type_ids")
        if types_in is None:
            raise ValueError(
                f"{name} has no 'mm_token_type_ids' (1 on image, 2 on video tokens): without it "
                f"{type(model).__name__} computes 1-D positions for its images; pass the processor's output"
            )
        if types_in.dim() != 2 or types_in.shape[0] != 1 or types_in.shape[1] > n:
            raise ValueError(
                f"{name}['mm_token_type_ids'] has shape {tuple(types_in.shape)}; expected [1, prompt tokens]"
            )
        covered = min(types_in.shape[1], n)
        types = torch.zeros(n, dtype=torch.long, device=tokens.device)
        types[:covered] = types_in[0, :covered].to(tokens.device).long()
        items: list[Item] = []
        for kind, value, pix_key, grid_key in self._KINDS:
            marked = types == value
            holds = tokens == ids[value]
            if bool((holds & ~marked)[covered:].any()):
                t = int((holds & ~marked)[covered:].nonzero()[0]) + covered
                if prompt_len is not None:
                    raise ValueError(
                        f"responses[{index}] holds the {kind} placeholder id {ids[value]} (token {t - prompt_len}): "
                        "images inside a response are not supported; put them in the prompt"
                    )
                raise ValueError(
                    f"path {index} holds the {kind} placeholder id {ids[value]} at token {t}, past what "
                    f"{name}['mm_token_type_ids'] covers; give the path's inputs for its whole sequence"
                )
            if not bool((marked == holds).all()):
                t = int((marked != holds).nonzero()[0])
                raise ValueError(
                    f"{name}['mm_token_type_ids'] marks token {t} as {'' if marked[t] else 'not '}{kind}, but its "
                    f"token id is {int(tokens[t])} ({kind} placeholder id: {ids[value]})"
                )
            runs = _runs(types.tolist(), value)
            pixels, grids = inputs.get(pix_key), inputs.get(grid_key)
            if not runs and pixels is None and grids is None:
                continue
            if pixels is None or grids is None:
                missing = pix_key if pixels is None else grid_key
                raise ValueError(f"{name} has {int(holds.sum())} {kind} tokens but no {missing!r}")
            if grids.dim() != 2 or grids.shape[1] != 3:
                raise ValueError(
                    f"{name}[{grid_key!r}] must be [n_{kind}s, 3] (t, h, w), got {tuple(grids.shape)}"
                )
            if pixels.dim() != 2 or pixels.shape[1] != width:
                raise ValueError(
                    f"{name}[{pix_key!r}] must be [patches, {width}] (channels x temporal x patch^2), got "
                    f"{tuple(pixels.shape)}"
                )
            grids = grids.long()
            if bool((grids < 1).any()) or bool((grids[:, 1:] % merge).any()):
                raise ValueError(
                    f"{name}[{grid_key!r}] = {grids.tolist()}: h and w must be multiples of {merge}"
                )
            patches = grids.prod(-1)
            if int(patches.sum()) != pixels.shape[0]:
                raise ValueError(
                    f"{name}[{pix_key!r}] has {pixels.shape[0]} patch rows; {grid_key} {grids.tolist()} gives "
                    f"{int(patches.sum())}"
                )
            tokens_per = (patches // merge**2).tolist()
            if sum(tokens_per) != int(holds.sum()):
                raise ValueError(
                    f"the prompt has {int(holds.sum())} {kind} tokens; {name}[{grid_key!r}] {grids.tolist()} gives "
                    f"{sum(tokens_per)}"
                )
            row, k = 0, 0
            for g, want, rows in zip(grids, tokens_per, patches.tolist(), strict=True):
                start, got = runs[k][0], 0
                while got < want:
                    got += runs[k][1] - runs[k][0]
                    end, k = runs[k][1], k + 1
                if got != want:
                    raise ValueError(
                        f"{name}[{grid_key!r}] {g.tolist()} gives {want} tokens; its placeholder run holds {got}"
                    )
                items.append(Item(kind, start, end, pixels[row : row + rows], g, rows))
                row += rows
        positions = self._positions(model, tokens, types, inputs, name)
        return positions, sorted(items, key=lambda it: it.start)

    def _positions(self, model, tokens, types, inputs, name):
        kwargs = {
            "image_grid_thw": inputs.get("image_grid_thw"),
            "video_grid_thw": inputs.get("video_grid_thw"),
        }
        if "second_per_grid_ts" in inputs:
            kwargs["second_per_grid_ts"] = inputs["second_per_grid_ts"]
        kwargs = {k: None if v is None else v.to(tokens.device) for k, v in kwargs.items()}
        positions, _ = model.model.get_rope_index(
            tokens.unsqueeze(0), mm_token_type_ids=types.unsqueeze(0), **kwargs
        )
        positions = positions[:, 0]
        limit = int(model.config.get_text_config().max_position_embeddings)
        top = int(positions.max())
        if top >= limit:
            key = "video_grid_thw" if kwargs.get("video_grid_thw") is not None else "image_grid_thw"
            raise ValueError(
                f"{name}[{key!r}] {kwargs[key].tolist()}: the sequence reaches mRoPE position {top}, beyond the model's "
                f"max_position_embeddings={limit}; sample fewer video frames (or raise max_position_embeddings)"
            )
        return positions
