"""Bad multimodal input: one line naming the field, raised before any gradient changes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from support import vlm  # noqa: E402

import prefixflow as pf  # noqa: E402
from prefixflow.schedule.driver import check_group  # noqa: E402

pytestmark = vlm.VERIFIED_TRANSFORMERS

WIDTH = 3 * vlm.TPATCH * vlm.PATCH**2


@pytest.fixture(scope="module")
def model():
    model = vlm.build_qwen("qwen2_5_vl")
    pf.apply_prefixflow(model)
    return model


def _group(prompt, inputs, responses=((5, 6, 7), (8, 9))):
    return pf.RolloutGroup(prompt, [torch.tensor(r) for r in responses], torch.tensor([1.0, -1.0]),
                           prompt_inputs=inputs)  # fmt: skip


def _image(**change):
    prompt, inputs = vlm.qwen_prompt(images=((1, 4, 4),))
    inputs.update(change)
    return prompt, {k: v for k, v in inputs.items() if v is not None}


def _cases():
    p, x = vlm.qwen_prompt(images=((1, 4, 4),))
    types = x["mm_token_type_ids"].clone()
    types[0, int((p == vlm.IMAGE).nonzero()[0])] = 0
    long_p, long_x = vlm.qwen_prompt(images=(), videos=((130, 2, 2),))
    cut = int((p == vlm.IMAGE).nonzero()[-1]) + 1  # the prompt stops on its last image token
    ends = (p[:cut], x | {"mm_token_type_ids": x["mm_token_type_ids"][:, :cut]})
    return {
        # image tokens vs pixel inputs: the count, the grid
        "token count": (
            *_image(
                image_grid_thw=torch.tensor([[1, 4, 8]]),
                pixel_values=torch.randn(32, WIDTH, dtype=torch.float64),
            ),
            "image_grid_thw",
        ),
        "grid vs pixels": (*_image(pixel_values=torch.randn(20, WIDTH, dtype=torch.float64)), "pixel_values"),
        "pixel width": (*_image(pixel_values=torch.randn(16, 7, dtype=torch.float64)), "pixel_values"),
        "type ids": (p, x | {"mm_token_type_ids": types}, "mm_token_type_ids"),
        # a processor key missing
        "no mm_token_type_ids": (*_image(mm_token_type_ids=None), "mm_token_type_ids"),
        "no grid": (*_image(image_grid_thw=None), "image_grid_thw"),
        "no inputs": (p, None, "pixel_values"),
        "unknown key": (*_image(image_sizes=torch.tensor([[56, 56]])), "image_sizes"),
        # a video past the model's position range (max_position_embeddings=512)
        "long video": (long_p, long_x, "video_grid_thw"),
        "prompt ends in an image": (*ends, "prompt"),
    }


CASES = _cases()


@pytest.mark.parametrize("case", list(CASES))
def test_refused_by_name_before_any_gradient(model, case):
    prompt, inputs, field = CASES[case]
    group = _group(prompt, inputs)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    with pytest.raises(ValueError) as err:
        pf.train_group(model, group)
    message = str(err.value)
    assert field in message and "\n" not in message, message
    assert all(bool((p.grad == 0.5).all()) for p in model.parameters())
    with pytest.raises(ValueError, match=field):
        check_group(model, group)


def test_image_inside_a_response(model):
    prompt, inputs = vlm.qwen_prompt(images=((1, 4, 4),))
    group = _group(prompt, inputs, responses=((5, vlm.IMAGE, 7), (8, 9)))
    with pytest.raises(ValueError, match="response"):
        pf.train_group(model, group)


def test_text_model_refuses_prompt_inputs():
    from prefixflow.integrations import hf

    text = hf.build_hf_model("qwen2-tiny", dtype=torch.float64)
    pf.apply_prefixflow(text)
    prompt, inputs = vlm.qwen_prompt(images=((1, 4, 4),))
    with pytest.raises(ValueError, match="prompt_inputs"):
        pf.train_group(text, _group(prompt, inputs))


def test_prompt_inputs_type():
    prompt, _ = vlm.qwen_prompt()
    with pytest.raises(TypeError, match="prompt_inputs"):
        _group(prompt, {"pixel_values": [1.0, 2.0]})


def test_an_older_transformers_is_refused_in_one_line(model, monkeypatch):
    """transformers 5.17 (the lent GPU machine's) trains these models 10-20% off: refused, gradients untouched."""
    import transformers

    before = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(
        ValueError, match=r"^vision-language models need transformers >= 5\.24\.0, found 5\.17\.0"
    ):
        check_group(model, _group(*_image()))
    for p, g in zip(model.parameters(), before, strict=True):
        assert (p.grad is None and g is None) or torch.equal(p.grad, g)
