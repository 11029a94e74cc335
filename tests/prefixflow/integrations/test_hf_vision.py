"""Vision-language models under PrefixFlow (Qwen2.5-VL, Qwen3-VL): images and video in the shared prompt.

Reference: the model's own forward on each full sequence ``[P || S_i]`` (its position function, its vision
merge; nothing of PrefixFlow), fp64, with HF's fp32 casts neutralised on both sides (support/vlm.py). Every
parameter is re-drawn non-zero first; each gradient, vision tower included, must match within 1e-9 per tensor,
have a non-zero norm, and be None exactly where the reference's is.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from support import vlm  # noqa: E402

import prefixflow as pf  # noqa: E402  (only `import prefixflow`: the HF adapters load through its entry point)

pytestmark = vlm.VERIFIED_TRANSFORMERS

KINDS = ("qwen2_5_vl", "qwen3_vl")


def make_group(kind, seed=0, responses=(4, 7, 2), **prompt_kw):
    prompt_kw.setdefault("videos", ((2, 4, 4),))
    prompt, inputs = vlm.qwen_prompt(per_frame=kind == "qwen3_vl", seed=seed, **prompt_kw)
    gen = torch.Generator().manual_seed(seed + 7)
    outs = [torch.randint(3, 200, (n,), generator=gen) for n in responses]
    adv = torch.tensor([1.0, -0.5, 0.3, -0.8][: len(responses)], dtype=torch.float64)
    return pf.RolloutGroup(prompt, outs, adv, prompt_inputs=inputs), inputs


@pytest.fixture(params=KINDS)
def setup(request, monkeypatch):
    model = vlm.build_qwen(request.param)
    vlm.neutralise_fp32(model, monkeypatch)
    group, inputs = make_group(request.param)
    want = vlm.reference_pg(model, group, inputs)
    pf.apply_prefixflow(model)
    return request.param, model, group, want


def test_exact_against_full_sequences(setup):
    """PrefixFlow padded and packed, microbatch 1, 2 and all, and the baseline: loss and every gradient
    within 1e-9; the tower's tokens counted once (PrefixFlow) or once per response (baseline)."""
    kind, model, group, (want_loss, want) = setup
    cases = [("prefixflow", layout, mb) for layout in ("padded", "packed") for mb in (None, 1, 2)]
    for system, layout, microbatch in [*cases, ("baseline", "packed", 2)]:
        model.zero_grad(set_to_none=True)
        stats = pf.train_group(model, group, system=system, layout=layout, microbatch=microbatch)
        assert abs(stats.loss - want_loss) <= 1e-9 * abs(want_loss), (system, layout, microbatch)
        vlm.compare_grads(model, want)
        patches = sum(int(it.grid.prod()) for it in _items(model, group))
        runs = 1 if system == "prefixflow" else group.n
        assert (stats.vision_tokens, stats.vision_runs) == (runs * patches, runs)
        assert stats.vision_flops > 0


def _items(model, group):
    return pf.adapter_for(model).prepare_inputs(model, group).items[0]


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_tower_runs_once_per_group(setup):
    """Counted at the tower itself: PrefixFlow encodes the prompt's patches once and runs the tower's
    backward once (Phase C), the baseline both once per response (microbatch 1: one call per sequence)."""
    kind, model, group, _ = setup
    calls, backwards = [], []
    hook = model.model.visual.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    back = model.model.visual.patch_embed.register_full_backward_hook(lambda m, gi, go: backwards.append(1))
    try:
        patches = sum(int(it.grid.prod()) for it in _items(model, group))
        for system, microbatch, want in (("prefixflow", 1, [patches]), ("baseline", 1, [patches] * group.n)):
            calls.clear()
            backwards.clear()
            stats = pf.train_group(model, group, system=system, microbatch=microbatch)
            per_kind = len({it.kind for it in _items(model, group)})  # images and videos encode apart
            assert sum(calls) == sum(want) and len(calls) == per_kind * len(want), (system, calls)
            assert len(backwards) == per_kind * len(want), (system, backwards)
            assert stats.vision_tokens == sum(want)
    finally:
        hook.remove()
        back.remove()


def test_frozen_tower_has_no_backward(setup, monkeypatch):
    """requires_grad=False on the tower: it runs without autograd (no activations kept, no backward), its
    parameters get no gradient on both sides, and the rest stays exact."""
    kind, model, group, _ = setup
    for p in model.model.visual.parameters():
        p.requires_grad_(False)
    _, inputs = make_group(kind)
    want_loss, want = vlm.reference_pg(model, group, inputs)
    seen = []
    hook = model.model.visual.register_forward_hook(
        lambda m, a, out: seen.append(out.pooler_output.requires_grad)
    )
    try:
        model.zero_grad(set_to_none=True)
        stats = pf.train_group(model, group, microbatch=2)
    finally:
        hook.remove()
    assert seen and not any(seen)
    assert abs(stats.loss - want_loss) <= 1e-9 * abs(want_loss)
    vlm.compare_grads(model, want)
    assert all(p.grad is None for p in model.model.visual.parameters())


def test_negative_controls_fail(setup, monkeypatch):
    """Each fault must break exactness: suffix positions restarted from the token count (1-D, ignoring the
    image's mRoPE extent), and the vision features detached (the tower's gradient dropped)."""
    from prefixflow.integrations.hf_vlm_families import QwenVL

    kind, model, group, (_, want) = setup
    real_positions, real_encode = QwenVL._positions, QwenVL.encode
    p = group.prompt_len

    def restarted(self, model, tokens, *args):
        pos = real_positions(self, model, tokens, *args).clone()
        pos[:, p:] = torch.arange(p, tokens.numel())
        return pos

    def detached(self, model, kind, items):
        out = real_encode(self, model, kind, items)
        out.pooler_output = tuple(t.detach() for t in out.pooler_output)
        if getattr(out, "deepstack_features", None):
            out.deepstack_features = [tuple(t.detach() for t in f) for f in out.deepstack_features]
        return out

    for name, fault in (("_positions", restarted), ("encode", detached)):
        with monkeypatch.context() as m:
            m.setattr(QwenVL, name, fault)
            model.zero_grad(set_to_none=True)
            pf.train_group(model, group)
            with pytest.raises(AssertionError):
                vlm.compare_grads(model, want, tol=1e-6)


def test_only_import_prefixflow_and_score_group():
    """A fresh process with only ``import prefixflow`` finds the VLM adapter (through the entry point);
    ``score_group`` gives the same log-probs through both systems."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys; sys.path.insert(0, 'tests'); import prefixflow as pf; from support import vlm; "
        "m = vlm.build_qwen('qwen3_vl'); assert 'prefixflow.integrations.hf' not in sys.modules; "
        "pf.apply_prefixflow(m); print(type(pf.adapter_for(m)).__name__)"
    )
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip().endswith("VisionLanguageAdapter")
    model = pf.apply_prefixflow(vlm.build_qwen("qwen2_5_vl"))
    group, _ = make_group("qwen2_5_vl")
    ours = pf.score_group(model, group)
    base = pf.score_group(model, group, system="baseline")
    assert all(float((a - b).abs().max()) <= 1e-12 for a, b in zip(ours, base, strict=True))
