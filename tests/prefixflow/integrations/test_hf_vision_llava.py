"""LLaVA-OneVision (SigLIP tower, vision_feature_select_strategy="full", anyres tiles) under PrefixFlow: one
tiled image and a two-image prompt (untiled), exact as test_hf_vision.py; the tower encodes each image's
tiles once per group."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from support import vlm  # noqa: E402

import prefixflow as pf  # noqa: E402

pytestmark = vlm.VERIFIED_TRANSFORMERS


@pytest.mark.parametrize("sizes", [((28, 50),), ((28, 50), (40, 28))], ids=["tiled", "two-images"])
def test_exact_and_counted(sizes, monkeypatch):
    model = vlm.build_llava_onevision()
    vlm.neutralise_fp32(model, monkeypatch)
    prompt, inputs = vlm.llava_prompt(model, sizes)
    gen = torch.Generator().manual_seed(1)
    responses = [torch.randint(3, 200, (n,), generator=gen) for n in (4, 9, 2)]
    group = pf.RolloutGroup(prompt, responses, torch.tensor([1.0, -0.5, 0.3]), prompt_inputs=inputs)
    want_loss, want = vlm.reference_pg(model, group, inputs)
    # SigLIP's post_layernorm is unused with vision_feature_layer=-1 hidden states: no gradient on both sides
    assert sorted(n for n, g in want.items() if g is None) == [
        "model.vision_tower.post_layernorm.bias", "model.vision_tower.post_layernorm.weight"
    ]  # fmt: skip
    pf.apply_prefixflow(model)
    tiles = 3 if len(sizes) == 1 else 2  # (28, 50): the base image and 2 tiles; two images: 1 each
    for system, layout, microbatch in (("prefixflow", "padded", None), ("prefixflow", "packed", 1),
                                       ("prefixflow", "padded", 2), ("baseline", "packed", 2)):  # fmt: skip
        model.zero_grad(set_to_none=True)
        stats = pf.train_group(model, group, system=system, layout=layout, microbatch=microbatch)
        assert abs(stats.loss - want_loss) <= 1e-9 * abs(want_loss), (system, layout, microbatch)
        vlm.compare_grads(model, want)
        runs = 1 if system == "prefixflow" else group.n
        assert (stats.vision_tokens, stats.vision_runs) == (runs * tiles * 16, runs)


def test_token_count_mismatch_is_refused():
    model = pf.apply_prefixflow(vlm.build_llava_onevision())
    prompt, inputs = vlm.llava_prompt(model, ((28, 50),))
    inputs["image_sizes"] = torch.tensor([[56, 56]])  # more tiles, more tokens than the prompt holds
    group = pf.RolloutGroup(prompt, [torch.tensor([5, 6])], torch.tensor([1.0]), prompt_inputs=inputs)
    with pytest.raises(ValueError, match="image_sizes"):
        pf.train_group(model, group)
