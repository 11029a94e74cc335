"""FLOPs of a vision-language group: the language model as a dense decoder (:mod:`harness.costmodel.flops`)
plus the vision tower, once per group under PrefixFlow (Phase A, its backward in Phase C) and once per full
sequence under the baseline (issue 32). Qwen2.5-VL's tower, per image or video of ``(t, h, w)`` patches:

* patch embedding: a convolution over each patch of ``3·t_patch·p²`` values, ``2·width·3·t_patch·p²`` per
  patch forward (counted as a convolution, the ``recurrent`` kind of :class:`~harness.costmodel.work.Flops`);
  its input is the pixels, so its backward is the weight gradient only;
* each block: ``qkv`` (``2·width·3·width``), ``proj`` (``2·width²``) and the SwiGLU MLP (``6·width·mlp``) per
  patch; attention over the pairs of each window (``window/patch`` patches square, cut at the grid's edge, per
  frame) or, in a full-attention block, of each frame (``h·w`` patches): ``4·width`` per pair forward, every
  pair (the tower's calls are unmasked and non-causal);
* the merger: per visual token (``merge²`` patches) ``2·(merge²·width)²`` and ``2·merge²·width·out``.

Trained, every GEMM and attention call costs 3x its forward (the first ``qkv`` included: the patch embedding's
output needs its gradient) and the patch embedding 2x; frozen, the tower runs under ``no_grad``: forward only.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.costmodel.shape import ModelShape
from harness.costmodel.work import Flops

__all__ = ["TowerShape", "VisionShape", "tower_shape", "tower_flops", "tower_runs", "vision_shape"]

VISION_TYPES = ("qwen2_5_vl",)


@dataclass(frozen=True)
class TowerShape:
    """The dimensions that set a Qwen2.5-VL vision tower's FLOPs."""

    width: int
    depth: int
    mlp: int
    out: int
    patch: int
    temporal_patch: int
    merge: int
    window: int  # pixels
    full_blocks: tuple[int, ...]

    def window_pairs(self, h: int, w: int) -> int:
        """Attention pairs of one frame's windowed attention: windows of ``window/patch`` patches a side,
        aligned to the merge units and cut at the grid's edge."""
        side = self.window // self.merge // self.patch  # merge units per window side
        hu, wu = h // self.merge, w // self.merge
        pairs = 0
        for r in range(0, hu, side):
            for c in range(0, wu, side):
                units = min(side, hu - r) * min(side, wu - c)
                pairs += (units * self.merge**2) ** 2
        return pairs


@dataclass(frozen=True)
class VisionShape:
    """A vision-language cell's cost-model shape: the language model, its tower, the prompt's images (their
    ``(t, h, w)`` patch grids) and whether the tower trains. The language model's fields read through."""

    text: ModelShape
    tower: TowerShape
    grids: tuple[tuple[int, int, int], ...]
    trained: bool
    systems = ("baseline", "prefixflow")  # the systems whose tower runs it models

    def __getattr__(self, name: str):
        if name in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "vocab_size"):
            return getattr(self.text, name)
        raise AttributeError(name)


def tower_shape(config) -> TowerShape:
    """The :class:`TowerShape` of a Qwen2.5-VL config (its ``vision_config``)."""
    if config.model_type not in VISION_TYPES:
        raise ValueError(
            f"the cost model covers the vision towers of {list(VISION_TYPES)}, not {config.model_type!r}"
        )
    v = config.vision_config
    return TowerShape(
        width=int(v.hidden_size), depth=int(v.depth), mlp=int(v.intermediate_size), out=int(v.out_hidden_size),
        patch=int(v.patch_size), temporal_patch=int(v.temporal_patch_size), merge=int(v.spatial_merge_size),
        window=int(v.window_size), full_blocks=tuple(int(i) for i in v.fullatt_block_indexes),
    )  # fmt: skip


def vision_shape(text: ModelShape, config, grids, trained: bool) -> VisionShape:
    return VisionShape(
        text, tower_shape(config), tuple(tuple(int(x) for x in g) for g in grids), bool(trained)
    )


def tower_flops(tower: TowerShape, grids, trained: bool) -> Flops:
    """One run of the tower over ``grids`` (forward and, when ``trained``, backward)."""
    gemm = attention = conv = 0
    wd = tower.width
    for t, h, w in grids:
        patches = t * h * w
        conv += 2 * patches * wd * 3 * tower.temporal_patch * tower.patch**2
        block = 2 * wd * 3 * wd + 2 * wd * wd + 6 * wd * tower.mlp
        gemm += tower.depth * patches * block
        units, m2 = patches // tower.merge**2, tower.merge**2
        gemm += units * (2 * (m2 * wd) ** 2 + 2 * m2 * wd * tower.out)
        full = t * (h * w) ** 2
        windowed = t * tower.window_pairs(h, w)
        for i in range(tower.depth):
            attention += 4 * wd * (full if i in tower.full_blocks else windowed)
    if trained:
        return Flops(3 * gemm, 3 * attention, 2 * conv)
    return Flops(gemm, attention, conv)


def tower_runs(system: str, n: int) -> int:
    """How often ``system`` runs the tower per group: once (PrefixFlow: the prefix node), else per sequence."""
    return 1 if system == "prefixflow" else n


def tower_work(shape: VisionShape, system: str, n: int) -> Flops:
    one = tower_flops(shape.tower, shape.grids, shape.trained)
    runs = tower_runs(system, n)
    return Flops(runs * one.gemm, runs * one.attention, runs * one.recurrent)
