"""Multi-step alignment (Table 3): bf16 passes the paper's rule and the normwise G bound over 20 AdamW steps,
fp32 passes its own tolerance, and every negative control (an injected fault) fails."""

from __future__ import annotations

import pytest
import torch

import prefixflow as pf
from prefixflow.checks.alignment import (
    CONTROLS,
    CORRECT,
    format_alignment,
    normwise,
    passes,
    run_alignment,
    tolerances,
)
from prefixflow.checks.faults import MicrobatchLossScale, ScalePrefixGradient, ShiftSuffixPositions

TINY = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256}


def test_pass_rule_is_the_papers():
    assert passes(torch.tensor([1.0]), torch.tensor([1.0 + 1e-3 + 1e-2 * 1.0 - 1e-9]))
    assert not passes(torch.tensor([1.0]), torch.tensor([1.02]))
    assert passes(torch.tensor([0.0]), torch.tensor([9e-4]))
    assert not passes(torch.tensor([0.0]), torch.tensor([1.1e-3]))


def test_tolerances_scale_with_unit_roundoff():
    assert tolerances(torch.bfloat16, 500) == (1e-3, 1e-2)  # the paper's, whatever the length
    tau_abs, tau_rel = tolerances(torch.float32, 100)
    assert tau_rel == pytest.approx(1e-2 * 2.0**-16 * 11) and tau_abs == pytest.approx(tau_rel / 10)
    assert tolerances(torch.float64, 100)[1] == pytest.approx(1e-2 * 2.0**-45 * 11)
    # normwise: a small tensor that lost 10% passes elementwise (absolute slack) but not in norm
    g = torch.full((64,), 1e-4)
    assert passes(g, 0.9 * g) and normwise(g, 0.9 * g) == pytest.approx(0.1)


def _by(rows, run):
    return [r for r in rows if r.run == run]


def test_bf16_every_control_fails_and_the_correct_run_passes():
    """The README's Table 3 precision and learning rate (bf16 mixed precision, lr 1e-5), fewer steps and shorter
    sequences: the correct copy passes; each injected fault fails by a wide margin."""
    rows = run_alignment(
        overrides=TINY,
        dtype=torch.bfloat16,
        steps=10,
        report_steps=(1, 10),
        prefix_len=32,
        suffix_len=12,
        n=3,
        microbatch=2,
        controls=CONTROLS,
    )
    correct = _by(rows, CORRECT)
    assert [(r.step, r.quantity) for r in correct] == [(s, q) for s in (1, 10) for q in "GLW"]
    assert all(r.passed for r in correct), format_alignment(rows)
    assert max(r.max_abs_diff for r in correct if r.quantity == "G") > 0  # bf16 noise is real
    for control in CONTROLS:
        mine = _by(rows, control)
        failed_steps = {r.step for r in mine if not r.passed}
        assert failed_steps == {1, 10}, (control, format_alignment(rows))
        g = [r for r in mine if r.quantity == "G"]
        assert all(r.norm_rel_diff > r.norm_tol and r.margin > 5 for r in g), (control, g)


def test_fp32_rows_use_fp32_tolerances_and_catch_every_fault():
    rows = run_alignment(
        overrides=TINY,
        dtype=torch.float32,
        steps=2,
        report_steps=(1, 2),
        prefix_len=24,
        suffix_len=8,
        n=3,
        layout="packed",
        microbatch=2,
        controls=CONTROLS,
    )
    correct = _by(rows, CORRECT)
    assert all(r.passed for r in correct), format_alignment(rows)
    assert all(r.tau_rel < 1e-5 and r.dtype == "fp32" for r in rows)
    assert max(r.norm_rel_diff for r in correct if r.quantity == "G") < 1e-5
    for control in CONTROLS:  # fp32 sees every fault elementwise too
        assert not any(r.paper_pass for r in _by(rows, control) if r.quantity == "G"), control


def test_bf16_qwen3_correct_run_passes():
    overrides = dict(TINY, head_dim=16, hidden_dim=96)
    rows = run_alignment(
        "qwen3:debugmodel",
        overrides=overrides,
        dtype=torch.bfloat16,
        steps=10,
        report_steps=(1, 10),
        prefix_len=32,
        suffix_len=12,
        n=4,
        microbatch=2,
    )
    assert all(r.passed for r in rows), format_alignment(rows)


def test_faults_touch_prefixflow_only():
    """A fault hook leaves the baseline (and a one-microbatch group, for the loss scale) exact."""
    from conftest import tiny_model

    group = pf.synthetic_group(97, 10, [4, 6, 3], seed=1)
    model = tiny_model("llama3")
    want = pf.train_group(model, group, system="baseline")
    want_g = [p.grad.clone() for p in model.parameters()]
    for fault in (ScalePrefixGradient(0.5), ShiftSuffixPositions(1), MicrobatchLossScale()):
        pf.add_hooks(model, fault)
        model.zero_grad(set_to_none=True)
        got = pf.train_group(model, group, system="baseline")
        assert got.loss == want.loss
        assert all(torch.equal(a.grad, b) for a, b in zip(model.parameters(), want_g, strict=True))
        pf.remove_hooks(model, fault)


def test_scale_prefix_gradient_is_exactly_scaled_gkv():
    """Scaling Phase C's contribution equals scaling the accumulated gK/gV (linearity, fp64)."""
    from conftest import tiny_model

    from prefixflow.state.kv_cache import PrefixKVCache

    group = pf.synthetic_group(97, 12, [5, 4], seed=2)
    model = tiny_model("llama3")
    fault = pf.add_hooks(model, ScalePrefixGradient(0.25))
    pf.train_group(model, group, microbatch=1)
    got = [p.grad.clone() for p in model.parameters()]
    pf.remove_hooks(model, fault)
    original = PrefixKVCache.backward_prefix

    def scaled(cache, *seeds):
        for entry in cache.layers.values():
            for leaf in (entry.prefix_k, entry.prefix_v):
                leaf.grad.mul_(0.25)
        original(cache, *seeds)

    model.zero_grad(set_to_none=True)
    PrefixKVCache.backward_prefix = scaled
    try:
        pf.train_group(model, group, microbatch=1)
    finally:
        PrefixKVCache.backward_prefix = original
    want = [p.grad for p in model.parameters()]
    assert max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want, strict=True)) < 1e-12


def test_inputs_are_validated():
    with pytest.raises(ValueError, match="report_steps"):
        run_alignment(overrides=TINY, steps=5, report_steps=(10,))
    with pytest.raises(ValueError, match="unknown control"):
        run_alignment(overrides=TINY, steps=1, report_steps=(1,), controls=["nope"])
    with pytest.raises(ValueError, match="microbatch_loss_scale"):
        run_alignment(overrides=TINY, steps=1, report_steps=(1,), controls=["microbatch_loss_scale"])


def test_a_nearly_cancelling_fp64_loss_is_bounded_by_its_terms():
    """Issue 36.13: the reported fp64 case, a loss of 0.026 off by ~5e-16 (2e-14 relative), beyond a bound taken
    of the sum (~5e-16): its terms' magnitudes bound its rounding. A loss off by 1e-3 still fails."""
    from prefixflow.checks.alignment import _step_rows

    tau = tolerances(torch.float64, 3 * (45 + 13 - 1))
    g, w = [torch.ones(2, dtype=torch.float64)], [torch.zeros(2, dtype=torch.float64)]

    def rows(loss, scale):
        base, got = (torch.tensor(v, dtype=torch.float64) for v in (0.026, loss))
        state = {"baseline": (g, base, w, w), CORRECT: (g, got, w, w)}
        (row,) = [r for r in _step_rows(2, state, ["w"], tau, "fp64", scale) if r.quantity == "L"]
        return row

    assert not rows(0.026 + 6e-16, None).passed  # the bound of the sum alone: the false FAIL
    assert rows(0.026 + 6e-16, 4.9).passed
    assert not rows(0.026 + 1e-3, 4.9).passed


def test_fp64_rows_catch_every_fault_with_the_loss_scale():
    """The loss's scale loosens L only: every negative control still fails (on G), the correct run passes."""
    rows = run_alignment(
        overrides={**TINY, "dim": 32}, dtype=torch.float64, steps=1, report_steps=(1,), prefix_len=12,
        suffix_len=6, n=2, microbatch=1, controls=CONTROLS,
    )  # fmt: skip
    assert all(r.passed for r in _by(rows, CORRECT)), format_alignment(rows)
    for control in CONTROLS:
        assert not any(r.passed for r in _by(rows, control) if r.quantity == "G"), control
