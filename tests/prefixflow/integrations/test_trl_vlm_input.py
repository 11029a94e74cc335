"""Bad VLM input under PrefixFlowGRPOTrainer: one line naming the field and the fix, raised by ``training_step``
before TRL's forward and before any gradient changes (issue 32, item 2)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

import support.trl_vlm as V  # noqa: E402
from support import vlm  # noqa: E402

pytestmark = vlm.VERIFIED_TRANSFORMERS


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    tr = V.trainer(tmp_path_factory.mktemp("qwen"), "qwen2_5_vl", model=V.conditioned(V.model("qwen2_5_vl")))
    return tr, V.micro_batch(tr)


def _refused(tr, inputs, match):
    """``training_step`` on ``inputs`` raises one line matching ``match``; no parameter got a gradient."""
    tr.model.zero_grad(set_to_none=True)
    tr._prepare_inputs = lambda _: inputs
    with pytest.raises(ValueError, match=match) as err:
        tr.training_step(tr.model, None)
    assert "\n" not in str(err.value)
    assert all(p.grad is None for p in tr.model.parameters())
    return str(err.value)


def _copy(inputs):
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()}


def test_image_tokens_that_do_not_match_the_pixel_inputs(qwen):
    tr, inputs = qwen
    bad = _copy(inputs)
    p = bad["prompt_ids"].shape[1]
    row = 0
    at = int((bad["prompt_ids"][row] == vlm.IMAGE).nonzero()[0])
    bad["prompt_ids"][row, at] = 7  # one placeholder fewer than image_grid_thw asks for
    bad["mm_token_type_ids"][row, at] = 0
    message = _refused(
        tr,
        bad,
        r"TRL micro-batch rows \[.*\]: the prompt has \d+ image tokens; row 0's inputs\['image_grid_thw'\]",
    )
    assert p == bad["prompt_ids"].shape[1] and "gives" in message
    bad = _copy(inputs)
    bad["image_grid_thw"][0, 2] += 2  # the grid no longer matches the patch rows
    _refused(tr, bad, r"TRL input 'pixel_values' has \d+ patch rows; image_grid_thw")


def test_images_inside_a_completion(qwen):
    tr, inputs = qwen
    bad = _copy(inputs)
    bad["completion_ids"][2, 1] = vlm.IMAGE
    _refused(
        tr,
        bad,
        r"completion_ids row 2 holds the image placeholder id 250 \(token 1\): images inside a completion",
    )
    bad = _copy(inputs)
    bad["mm_token_type_ids"][3, bad["prompt_ids"].shape[1]] = 1  # a tool's image response
    _refused(tr, bad, r"TRL input 'mm_token_type_ids' marks completion token 0 of row 3 as an image")


def test_a_processor_output_missing_a_key_the_model_needs(qwen, tmp_path):
    tr, inputs = qwen
    bad = _copy(inputs)
    del bad["mm_token_type_ids"]  # Qwen2.5-VL would silently fall back to 1-D positions
    _refused(tr, bad, r"row \d's inputs has no 'mm_token_type_ids' \(1 on image, 2 on video tokens\)")
    bad = _copy(inputs)
    del bad["pixel_values"]
    _refused(tr, bad, r"TRL input 'image_grid_thw' comes without 'pixel_values'")
    gemma = V.trainer(tmp_path, "gemma3", model=V.conditioned(V.model("gemma3")))
    batch = V.micro_batch(gemma)
    del batch["token_type_ids"]
    _refused(gemma, batch, r"(row \d's|the prompt's) inputs has no 'token_type_ids' \(1 on image tokens\)")


def test_a_right_padding_processor_and_keys_of_other_families(qwen):
    tr, inputs = qwen
    bad = _copy(inputs)
    mask = bad["prompt_mask"].bool()
    row = int((~mask).sum(-1).argmax())  # the row most padded: its image marks land on its padding
    pads = int((~mask[row]).sum())
    assert pads > 2
    bad["mm_token_type_ids"][row, : mask.shape[1]] = bad["mm_token_type_ids"][row, : mask.shape[1]].roll(
        -pads
    )
    _refused(tr, bad, r"marks row \d+'s left padding as image tokens.*padding_side='left'")
    bad = _copy(inputs)
    bad["pixel_attention_mask"] = torch.ones(3)
    _refused(tr, bad, r"TRL input 'pixel_attention_mask' is not supported by PrefixFlowGRPOTrainer")


def test_a_vlm_type_it_does_not_train_is_refused_at_construction(tmp_path):
    model = vlm.build_llava_onevision(dtype=torch.float32)
    with pytest.raises(
        ValueError, match=r"vision-language model type 'llava_onevision' \(trained: \['qwen2_5_vl'"
    ):
        V.trainer(tmp_path, "qwen2_5_vl", model=model)
