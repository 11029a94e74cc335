"""Gemma-3 with its vision tower under PrefixFlow: image tokens attend to each other both ways (with
``token_type_ids``), and the local layers' sliding window (16 tokens) is shorter than the group (42), so each
suffix query sees only the cached prefix keys inside its window. Reference and tolerances as
test_hf_vision.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from support import vlm  # noqa: E402

import prefixflow as pf  # noqa: E402

pytestmark = vlm.VERIFIED_TRANSFORMERS


@pytest.fixture
def setup(monkeypatch):
    model = vlm.build_gemma3(sliding_window=16)
    vlm.neutralise_fp32(model, monkeypatch)
    prompt, inputs = vlm.gemma_prompt(n_images=2, text=(14, 3))
    gen = torch.Generator().manual_seed(1)
    responses = [torch.randint(3, 200, (n,), generator=gen) for n in (4, 9, 2)]
    group = pf.RolloutGroup(prompt, responses, torch.tensor([1.0, -0.5, 0.3]), prompt_inputs=inputs)
    assert max(group.path_lens) > 16 + group.prompt_len // 2
    want = vlm.reference_pg(model, group, inputs)
    pf.apply_prefixflow(model)
    return model, group, want


def test_exact_with_bidirectional_images_and_a_short_window(setup):
    model, group, (want_loss, want) = setup
    assert float(model.model.multi_modal_projector.mm_input_projection_weight.detach().abs().min()) > 0
    cases = [("prefixflow", "padded", None), ("prefixflow", "padded", 1), ("prefixflow", "packed", 2),
             ("prefixflow", "packed", None), ("baseline", "padded", 2)]  # fmt: skip
    for system, layout, microbatch in cases:
        model.zero_grad(set_to_none=True)
        stats = pf.train_group(model, group, system=system, layout=layout, microbatch=microbatch)
        assert abs(stats.loss - want_loss) <= 1e-9 * abs(want_loss), (system, layout, microbatch)
        vlm.compare_grads(model, want)
        runs = 1 if system == "prefixflow" else group.n
        assert (stats.vision_tokens, stats.vision_runs) == (runs * 2 * 16, runs)


def test_negative_controls_fail(setup, monkeypatch):
    """A causal image mask (no bidirectional spans), and the window dropped, each break exactness."""
    from prefixflow.integrations.hf import HFAdapter
    from prefixflow.integrations.hf_vlm_gemma import Gemma3

    model, group, (_, want) = setup
    faults = [(Gemma3, "blocks", lambda self, prepared: None),
              (HFAdapter, "windows", lambda self, model: {})]  # fmt: skip
    for owner, name, fault in faults:
        with monkeypatch.context() as m:
            m.setattr(owner, name, fault)
            model.zero_grad(set_to_none=True)
            pf.train_group(model, group, layout="packed")
            with pytest.raises(AssertionError):
                vlm.compare_grads(model, want, tol=1e-6)


def test_missing_token_type_ids_is_refused(setup):
    model, group, _ = setup
    inputs = {"pixel_values": group.prompt_inputs["pixel_values"]}
    bad = pf.RolloutGroup(group.prompt, group.responses, group.advantages, prompt_inputs=inputs)
    with pytest.raises(ValueError, match="token_type_ids"):
        pf.train_group(model, bad)
    few = {**group.prompt_inputs, "pixel_values": group.prompt_inputs["pixel_values"][:1]}
    with pytest.raises(ValueError, match="pixel_values"):
        pf.train_group(
            model, pf.RolloutGroup(group.prompt, group.responses, group.advantages, prompt_inputs=few)
        )
