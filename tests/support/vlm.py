"""Tiny vision-language models (random weights, fp64) and their prompts, built as their processors would.

No processor or hub: the prompt's token ids and ``prompt_inputs`` are what a Qwen-VL processor returns for
``text + <|vision_start|> <|image_pad|> * n <|vision_end|> + text`` (batch of one). The reference side
(:func:`reference_pg`) is the model's own forward on each full sequence ``[P || S_i]``, nothing of PrefixFlow.
"""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from packaging.version import Version

from prefixflow.integrations.hf_vision import VLM_MIN_TRANSFORMERS

# The VLM tests' mark: PrefixFlow refuses vision-language models on older transformers (docs/gpu.md).
VERIFIED_TRANSFORMERS = pytest.mark.skipif(
    Version(importlib.metadata.version("transformers")) < Version(VLM_MIN_TRANSFORMERS),
    reason=f"vision-language models need transformers >= {VLM_MIN_TRANSFORMERS}",
)

VOCAB = 256
IMAGE, VIDEO, START, END = 250, 251, 252, 253  # placeholder ids inside the tiny vocabulary
PATCH, MERGE, TPATCH = 14, 2, 2


def _text(**extra):
    return {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **extra,
    }  # fmt: skip


def build_qwen(kind: str = "qwen2_5_vl", seed: int = 0, dtype=torch.float64):
    """Qwen2.5-VL or Qwen3-VL (deepstack) with a 2-block tower, every parameter re-drawn non-zero."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )

    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
               vision_end_token_id=END)  # fmt: skip
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=TPATCH, out_hidden_size=64)  # fmt: skip
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    if kind == "qwen2_5_vl":
        config = Qwen2_5_VLConfig(
            text_config=_text(rope_parameters=rope),
            vision_config={**vision, "window_size": 56, "fullatt_block_indexes": [1]},
            **ids,
        )
        cls = Qwen2_5_VLForConditionalGeneration
    else:
        config = Qwen3VLConfig(
            text_config=_text(head_dim=16, rope_parameters={**rope, "mrope_interleaved": True}),
            vision_config={**vision, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
            **ids,
        )
        cls = Qwen3VLForConditionalGeneration
    torch.manual_seed(seed)
    model = cls(config).to(dtype)
    model.set_attn_implementation("sdpa")
    randomise(model, seed)
    return model


GEMMA_IMAGE, BOI, EOI, PER_IMAGE, IMAGE_SIZE = 250, 251, 252, 4, 28


def build_gemma3(seed: int = 0, dtype=torch.float64, sliding_window: int = 16):
    """Gemma-3 with a 2-layer SigLIP tower (28 px, 7 px patches: 16 patches pooled to 4 image tokens), one
    local (sliding-window) and one global layer; every parameter re-drawn non-zero (its
    ``mm_input_projection_weight`` starts at zero)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = _text(head_dim=16, sliding_window=sliding_window, query_pre_attn_scalar=16,
                 layer_types=["sliding_attention", "full_attention"], model_type="gemma3_text")  # fmt: skip
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=7, vision_use_head=False)  # fmt: skip
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=PER_IMAGE,
                          image_token_index=GEMMA_IMAGE, boi_token_index=BOI, eoi_token_index=EOI)  # fmt: skip
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).to(dtype)
    model.set_attn_implementation("sdpa")
    randomise(model, seed)
    return model


def gemma_prompt(n_images: int = 1, seed: int = 0, text=(5, 3), dtype=torch.float64):
    """Token ids and ``prompt_inputs`` (``pixel_values``, ``token_type_ids``) as Gemma-3's processor gives:
    ``<boi> <image>*4 <eoi>`` per image."""
    gen = torch.Generator().manual_seed(seed)
    words = lambda n: torch.randint(3, GEMMA_IMAGE, (n,), generator=gen)  # noqa: E731
    parts = [words(text[0])]
    for _ in range(n_images):
        parts += [torch.tensor([BOI, *[GEMMA_IMAGE] * PER_IMAGE, EOI]), words(2)]
    parts.append(words(text[1]))
    prompt = torch.cat(parts)
    pixels = torch.randn(n_images, 3, IMAGE_SIZE, IMAGE_SIZE, generator=gen, dtype=dtype)
    return prompt, {"pixel_values": pixels, "token_type_ids": (prompt == GEMMA_IMAGE).long().unsqueeze(0)}


OV_IMAGE, OV_VIDEO, OV_SIZE = 250, 251, 28


def build_llava_onevision(seed: int = 0, dtype=torch.float64):
    """LLaVA-OneVision: a 2-layer SigLIP tower (28 px, 7 px patches), vision_feature_select_strategy="full",
    anyres tiles over [[28, 56], [56, 28], [56, 56]], a Qwen2 language model; every parameter non-zero."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=OV_SIZE, patch_size=7, vision_use_head=False)  # fmt: skip
    config = LlavaOnevisionConfig(
        text_config=_text(model_type="qwen2"), vision_config=vision, image_token_index=OV_IMAGE,
        video_token_index=OV_VIDEO, vision_feature_select_strategy="full", vision_feature_layer=-1,
        image_grid_pinpoints=[[28, 56], [56, 28], [56, 56]],
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlavaOnevisionForConditionalGeneration(config).to(dtype)
    model.set_attn_implementation("sdpa")
    randomise(model, seed)
    return model


def llava_prompt(model, sizes=((28, 50),), seed: int = 0, text=(5, 3), dtype=torch.float64):
    """Token ids and ``prompt_inputs`` (``pixel_values`` [images, tiles, 3, 28, 28], ``image_sizes``), each
    image's placeholder count taken from the model's own packing (as the processor computes it)."""
    from prefixflow.integrations.hf_vlm_llava import LlavaOnevision

    gen = torch.Generator().manual_seed(seed)
    words = lambda n: torch.randint(3, OV_IMAGE, (n,), generator=gen)  # noqa: E731
    image_sizes = torch.tensor(sizes)
    lens = LlavaOnevision()._tokens_per_image(model, image_sizes, [len(sizes) == 1] * len(sizes))
    parts = [words(text[0])]
    for n in lens:
        parts += [torch.full((n,), OV_IMAGE), words(2)]
    parts.append(words(text[1]))
    tiles = 5  # the base image and up to 4 tiles (the processor pads to the largest count)
    pixels = torch.randn(len(sizes), tiles, 3, OV_SIZE, OV_SIZE, generator=gen, dtype=dtype)
    inputs = {"pixel_values": pixels, "image_sizes": image_sizes}
    if len(sizes) > 1:
        inputs["batch_num_images"] = torch.tensor([len(sizes)])
    return torch.cat(parts), inputs


def randomise(model, seed: int) -> None:
    """Every parameter random and non-zero (zero-initialised projections would make gradients vacuous);
    attention q/k scaled up so a wrong position moves the gradients far past the tolerance."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) / max(1, p.shape[-1]) ** 0.5)
            if any(k in name for k in ("q_proj", "k_proj")):
                p.mul_(3.0)


def image_block(grid: tuple[int, int, int], token: int = IMAGE) -> torch.Tensor:
    """``<vision_start> <pad>*n <vision_end>`` for one image/video of ``grid`` (t, h, w) patches."""
    t, h, w = grid
    n = t * h * w // MERGE**2
    return torch.tensor([START, *[token] * n, END])


def pixels(grid, gen, dtype=torch.float64) -> torch.Tensor:
    t, h, w = grid
    return torch.randn(t * h * w, 3 * TPATCH * PATCH * PATCH, generator=gen, dtype=dtype)


def qwen_prompt(
    images=((1, 4, 4),), videos=(), seed: int = 0, text=(5, 3), dtype=torch.float64, per_frame=False
):
    """Token ids and ``prompt_inputs`` of ``text[0]`` tokens, the images, the videos, ``text[1]`` tokens.
    ``per_frame``: a video's temporal slices each in their own vision block (Qwen3-VL's processor)."""
    gen = torch.Generator().manual_seed(seed)
    words = lambda n: torch.randint(3, IMAGE, (n,), generator=gen)  # noqa: E731
    parts, inputs = [words(text[0])], {}
    for key, grids, token in (("image", images, IMAGE), ("video", videos, VIDEO)):
        if not grids:
            continue
        values = []
        for g in grids:
            blocks = [(1, g[1], g[2])] * g[0] if per_frame and key == "video" else [g]
            for b in blocks:
                parts += [image_block(b, token), words(2)]
            values.append(pixels(g, gen, dtype))
        inputs["pixel_values" if key == "image" else "pixel_values_videos"] = torch.cat(values)
        inputs[f"{key}_grid_thw"] = torch.tensor(grids)
    parts.append(words(text[1]))
    prompt = torch.cat(parts)
    types = torch.zeros(1, prompt.numel(), dtype=torch.long)
    types[0, prompt == IMAGE] = 1
    types[0, prompt == VIDEO] = 2
    inputs["mm_token_type_ids"] = types
    return prompt, inputs


def reference_pg(model, group, inputs) -> tuple[float, dict[str, torch.Tensor | None]]:
    """loss='pg' through the model's own forward on each full sequence (its own position function, its own
    vision merge; ``rope_deltas`` reset before each call). Returns the loss and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    total, p = 0.0, group.prompt_len
    for i, response in enumerate(group.responses):
        seq = torch.cat([group.prompt, response[:-1]]).unsqueeze(0)
        extra = dict(inputs)
        for key in ("mm_token_type_ids", "token_type_ids"):
            if key in extra:
                extra[key] = torch.cat([extra[key], extra[key].new_zeros(1, response.numel() - 1)], dim=1)
        model.model.rope_deltas = None
        logits = model(input_ids=seq, use_cache=False, **extra).logits[0, p - 1 :]
        logp = torch.log_softmax(logits.double(), -1).gather(-1, response.unsqueeze(-1)).squeeze(-1)
        loss = -(group.advantages[i].double() * logp.mean()) / group.n
        loss.backward()
        total += loss.item()
    return total, {n: None if q.grad is None else q.grad.clone() for n, q in model.named_parameters()}


def neutralise_fp32(model, monkeypatch) -> None:
    """HF's fp32 casts compute in the model's dtype (both systems run the same patched model): every RMSNorm
    (instance-level) and the vision towers' rotary embedding (module function, through ``monkeypatch``).
    Stock, they round fp64 to fp32 and bound agreement near 1e-7, which would hide a schedule error."""
    import transformers.models.qwen2_5_vl.modeling_qwen2_5_vl as q25
    import transformers.models.qwen3_vl.modeling_qwen3_vl as q3

    def rotary(q, k, cos, sin):
        cos, sin = cos.unsqueeze(-2).to(q.dtype), sin.unsqueeze(-2).to(q.dtype)
        return q * cos + q25.rotate_half(q) * sin, k * cos + q25.rotate_half(k) * sin

    for module in (q25, q3):
        monkeypatch.setattr(module, "apply_rotary_pos_emb_vision", rotary)
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            gemma = type(module).__name__.startswith("Gemma")  # (1 + w) x / rms(x)
            eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))

            def forward(x, m=module, gemma=gemma, eps=eps):
                normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
                return normed * (1.0 + m.weight) if gemma else m.weight * normed

            module.forward = forward


def compare_grads(model, ref: dict, tol: float = 1e-9) -> float:
    """Every gradient within ``tol`` of the reference per tensor (max|d| / max|ref|), each with a non-zero
    norm, and a None gradient exactly where the reference has one. Returns the worst ratio.

    One gradient is zero in exact arithmetic: an attention key projection's bias (it shifts every score of
    a query equally, and softmax cancels it), left as rounding noise on both sides. Such a tensor (named
    ``k_proj.bias``, at most 1e-10 of the largest gradient) must stay as small here."""
    worst = 0.0
    scale = max(float(g.abs().max()) for g in ref.values() if g is not None)
    for name, p in model.named_parameters():
        want = ref[name]
        assert (p.grad is None) == (want is None), (
            f"{name}: grad is {p.grad is None}, reference {want is None}"
        )
        if want is None:
            continue
        if name.endswith("k_proj.bias") and float(want.abs().max()) <= 1e-10 * scale:
            assert float(p.grad.abs().max()) <= 1e-10 * scale, f"{name}: should be ~0"
            continue
        assert float(want.norm()) > 0 and float(p.grad.norm()) > 0, f"{name}: zero gradient"
        ratio = float((p.grad - want).abs().max() / want.abs().max())
        assert ratio <= tol, f"{name}: {ratio:.3g}"
        worst = max(worst, ratio)
    return worst
