"""Multi-step alignment (Table 3): bf16 passes the paper's rule over 20 AdamW steps; fp32 is ~1e-7."""

from __future__ import annotations

import pytest
import torch

from prefixflow.alignment import format_alignment, passes, run_alignment

TINY = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256}


def test_pass_rule_is_the_papers():
    assert passes(torch.tensor([1.0]), torch.tensor([1.0 + 1e-3 + 1e-2 * 1.0 - 1e-9]))
    assert not passes(torch.tensor([1.0]), torch.tensor([1.02]))
    assert passes(torch.tensor([0.0]), torch.tensor([9e-4]))
    assert not passes(torch.tensor([0.0]), torch.tensor([1.1e-3]))


@pytest.mark.parametrize("family", ["llama3:debugmodel", "qwen3:debugmodel"])
def test_bf16_twenty_steps_pass(family):
    overrides = dict(TINY, **({"head_dim": 16, "hidden_dim": 96} if family.startswith("qwen3") else {}))
    rows = run_alignment(
        family,
        overrides=overrides,
        dtype=torch.bfloat16,
        steps=20,
        prefix_len=48,
        suffix_len=16,
        n=4,
        microbatch=2,
    )
    assert [(r.step, r.quantity) for r in rows] == [(s, q) for s in (1, 10, 20) for q in "GLW"]
    assert all(r.passed for r in rows), format_alignment(rows)
    # bf16 noise is real (the comparison is not trivially zero) but small.
    assert max(r.max_abs_diff for r in rows if r.quantity == "G") > 0


def test_fp32_gaps_are_tiny_and_bf16_rule_would_catch_a_real_bug():
    rows = run_alignment(
        overrides=TINY,
        dtype=torch.float32,
        steps=10,
        report_steps=(1, 10),
        prefix_len=40,
        suffix_len=12,
        n=3,
        layout="packed",
    )
    assert all(r.passed for r in rows)
    assert max(r.max_abs_diff / max(r.max_abs_value, 1e-30) for r in rows if r.quantity == "G") < 1e-5
    # A wrong gradient (e.g. a missing 1/N) fails the rule.
    g = torch.randn(100)
    assert not passes(g, g * 0.5)


def test_report_steps_are_validated():
    with pytest.raises(ValueError, match="report_steps"):
        run_alignment(overrides=TINY, steps=5, report_steps=(10,))
