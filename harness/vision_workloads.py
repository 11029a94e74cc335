"""Multimodal workloads (issue 32): seeded rollout groups whose shared prompt is mostly image or video tokens,
the shapes of the paper's Table 1 (chart QA, video RLVR).

Each shape is a pydantic model (a spec's ``axes.vision`` entry); :meth:`group` builds a
``prefixflow.RolloutGroup`` for a Qwen-VL model with ``prompt_inputs`` as its processor returns them for the
prompt alone: ``pixel_values`` (or ``pixel_values_videos``) of the right grid, ``image_grid_thw`` (or
``video_grid_thw``) and ``mm_token_type_ids``. The prompt is ``system text, <|vision_start|>, the
placeholders, <|vision_end|>, the question``; the answers have lengths uniform in ``[answer_min, answer_max]``.

Sizes are in **visual tokens** (after the model's 2x2 spatial merge), so a shape means the same prompt
length on every Qwen-VL model: ``image_tokens: [rows, cols]`` is ``rows*28 x cols*28`` pixels at Qwen's 14 px
patches. A video is ``frames`` frames, two per temporal patch (Qwen-VL's ``temporal_patch_size``), each pair
``frame_tokens`` visual tokens.

- ``chart_qa``: one image (default 32 x 32 = 1,024 visual tokens), a short question, answers of 32-256 tokens;
- ``video``: 16 frames of 12 x 16 tokens per frame pair (1,536 visual tokens), a short question, answers of
  32 tokens: a prefix ratio of 0.980 (the paper's video RLVR median: 98.0%).
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["VisionShape", "ChartQAShape", "VideoShape", "MAX_VISUAL_TOKENS", "TEMPORAL_PATCH"]

MAX_VISUAL_TOKENS = 262_144  # per prompt (a 1-hour video at Qwen-VL's 2 fps sampling is ~10^5)
TEMPORAL_PATCH = 2  # Qwen-VL: frames per temporal patch
Side = Annotated[int, Field(ge=1, le=512, description="visual tokens along one side (<= 512)")]
Text = Annotated[int, Field(ge=1, le=65_536)]
Grid = Annotated[tuple[Side, Side], Field(strict=False, description="[rows, cols] of visual tokens")]


class _VisionShape(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)
    seed: int = Field(0, ge=0, le=2**32 - 1)
    system_len: Text = 16
    question_len: Text = 32
    answer_min: Text = 32
    answer_max: Text = 256

    @model_validator(mode="after")
    def _bounded(self):
        if self.answer_min > self.answer_max:
            raise ValueError(f"answer_min {self.answer_min} > answer_max {self.answer_max}; swap them")
        if self.visual_tokens > MAX_VISUAL_TOKENS:
            raise ValueError(
                f"{self.visual_tokens:,} visual tokens per prompt, more than {MAX_VISUAL_TOKENS:,}; shrink the "
                f"image_tokens / frame_tokens / frames"
            )
        return self

    @property
    def visual_tokens(self) -> int:
        raise NotImplementedError

    @property
    def prompt_len(self) -> int:
        return self.system_len + 2 + self.visual_tokens + self.question_len

    @property
    def prefix_ratio(self) -> float:
        """The prompt's share of a path of the mean answer length."""
        return self.prompt_len / (self.prompt_len + (self.answer_min + self.answer_max) / 2)

    def nominal(self) -> tuple[int, int]:
        """(prompt length, longest answer): a cell's prefix_len and suffix_len."""
        return self.prompt_len, self.answer_max

    def grid(self, patch_merge: int) -> tuple[int, int, int]:
        """The ``(t, h, w)`` patch grid the tower reads (``patch_merge``: the model's spatial merge)."""
        raise NotImplementedError

    def grids(self, merge: int = 2) -> list[tuple[int, int, int]]:
        return [self.grid(merge)]

    def group(self, model, n: int, dtype: torch.dtype):
        """The seeded group of ``n`` answers for the Qwen-VL ``model`` (its placeholder ids, patch and merge)."""
        from prefixflow import RolloutGroup

        config, vision = model.config, model.config.vision_config
        if vision.temporal_patch_size != TEMPORAL_PATCH or not hasattr(config, "vision_start_token_id"):
            raise ValueError(
                f"vision workloads build Qwen-VL prompts (temporal patch {TEMPORAL_PATCH}); model type "
                f"{config.model_type!r} is not one"
            )
        ids = (
            config.image_token_id,
            config.video_token_id,
            config.vision_start_token_id,
            config.vision_end_token_id,
        )
        gen = torch.Generator().manual_seed(self.seed)
        words = lambda k: torch.randint(0, min(ids), (k,), generator=gen)  # noqa: E731
        t, h, w = self.grid(vision.spatial_merge_size)
        token = config.video_token_id if self.kind == "video" else config.image_token_id
        placeholders = torch.full((t * h * w // vision.spatial_merge_size**2,), token)
        prompt = torch.cat([
            words(self.system_len), torch.tensor([config.vision_start_token_id]), placeholders,
            torch.tensor([config.vision_end_token_id]), words(self.question_len),
        ])  # fmt: skip
        width = 3 * TEMPORAL_PATCH * vision.patch_size**2
        pixels = torch.randn(t * h * w, width, generator=gen, dtype=torch.float64).to(dtype)
        key = "video" if self.kind == "video" else "image"
        types = torch.zeros(1, prompt.numel(), dtype=torch.long)
        types[0, prompt == token] = 2 if key == "video" else 1
        inputs = {
            "pixel_values_videos" if key == "video" else "pixel_values": pixels,
            f"{key}_grid_thw": torch.tensor([[t, h, w]]),
            "mm_token_type_ids": types,
        }
        lens = torch.randint(self.answer_min, self.answer_max + 1, (n,), generator=gen).tolist()
        responses = [words(k) for k in lens]
        advantages = torch.randn(n, generator=gen, dtype=torch.float64)
        return RolloutGroup(prompt=prompt, responses=responses, advantages=advantages, prompt_inputs=inputs)


class ChartQAShape(_VisionShape):
    kind: Literal["chart_qa"] = "chart_qa"
    image_tokens: Grid = (32, 32)

    @property
    def visual_tokens(self) -> int:
        return self.image_tokens[0] * self.image_tokens[1]

    @property
    def label(self) -> str:
        r, c = self.image_tokens
        return f"chart_qa {r}x{c} q{self.question_len} a{self.answer_min}-{self.answer_max}"

    def grid(self, merge: int = 2) -> tuple[int, int, int]:
        return 1, self.image_tokens[0] * merge, self.image_tokens[1] * merge


class VideoShape(_VisionShape):
    kind: Literal["video"] = "video"
    frames: int = Field(16, ge=TEMPORAL_PATCH, le=4096, description="frames, a multiple of 2 (<= 4096)")
    frame_tokens: Grid = (12, 16)
    question_len: Text = 16
    answer_min: Text = 32
    answer_max: Text = 32

    @model_validator(mode="after")
    def _whole_patches(self) -> VideoShape:
        if self.frames % TEMPORAL_PATCH:
            raise ValueError(
                f"frames {self.frames} is not a multiple of {TEMPORAL_PATCH} (Qwen-VL's temporal patch); use "
                f"{self.frames + 1}"
            )
        return self

    @property
    def visual_tokens(self) -> int:
        return self.frames // TEMPORAL_PATCH * self.frame_tokens[0] * self.frame_tokens[1]

    @property
    def label(self) -> str:
        r, c = self.frame_tokens
        return f"video {self.frames}f {r}x{c} q{self.question_len} a{self.answer_min}-{self.answer_max}"

    def grid(self, merge: int = 2) -> tuple[int, int, int]:
        return self.frames // TEMPORAL_PATCH, self.frame_tokens[0] * merge, self.frame_tokens[1] * merge


VisionShape = Annotated[ChartQAShape | VideoShape, Field(discriminator="kind")]
