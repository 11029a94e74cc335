"""The modelled time (``harness.costmodel.roofline``): each op is max(FLOPs/π, bytes/β), views move
nothing, in-place ops write their output, the FLOPs are the counters', and a fake step models the same as a
real one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.costmodel.counting import count_flops
from harness.costmodel.roofline import H20_BF16_FLOPS, H20_HBM_BYTES, RooflineTimer
from harness.estimate.fake import fake_mode

PI, BETA = 1e12, 1e9  # round rates, so each bound is easy to write down


def test_a_matmul_is_bound_by_its_flops_or_its_bytes_whichever_is_slower():
    a, b = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(32, 16, dtype=torch.bfloat16)
    with RooflineTimer(PI, BETA) as roof:
        a @ b
    flops, moved = 2 * 64 * 32 * 16, 2 * (64 * 32 + 32 * 16 + 64 * 16)
    assert (roof.flops, roof.bytes) == (flops, moved)
    assert roof.seconds == pytest.approx(max(flops / PI, moved / BETA)) and moved / BETA > flops / PI
    with RooflineTimer(PI, 1e15) as fast_memory:
        a @ b
    assert fast_memory.seconds == pytest.approx(flops / PI)  # now the arithmetic bounds it


def test_views_move_nothing_and_in_place_ops_write_their_output():
    x, y = torch.randn(1000), torch.randn(1000)
    with RooflineTimer(PI, BETA) as roof:
        v = x.view(10, 100).t()
        v.contiguous()  # a copy: reads 4,000 B, writes 4,000 B
        x.add_(y)  # reads x and y, writes x
        x + y  # reads x and y, writes a new tensor
    assert roof.by_op["view"].bytes == 0 and roof.by_op["t"].bytes == 0
    assert roof.by_op["add_"].bytes == 3 * 4000 and roof.by_op["add"].bytes == 3 * 4000
    assert roof.by_op["clone"].bytes == 2 * 4000
    assert roof.flops == 0 and roof.seconds == pytest.approx(roof.bytes / BETA)


def test_the_flops_are_the_counters_and_a_fake_step_models_as_the_real_one():
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)

    def step(x):
        q = (x @ w).view(1, 4, 32, 16)
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        out.sum().backward()

    x = torch.randn(32, 64)
    with RooflineTimer() as real:
        counted, _ = count_flops(lambda: step(x))
    assert real.flops == counted.total > 0
    mode = fake_mode()
    with mode:
        fw, fx = mode.from_tensor(w).detach().requires_grad_(True), mode.from_tensor(x)
    with mode, RooflineTimer() as fake:
        def fake_step():
            q = (fx @ fw).view(1, 4, 32, 16)
            F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()

        fake_step()
    assert (fake.flops, fake.bytes) == (real.flops, real.bytes)
    assert fake.seconds == pytest.approx(real.seconds)
    assert (H20_BF16_FLOPS, H20_HBM_BYTES) == (148e12, 4.0e12)


def test_the_rates_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        RooflineTimer(0, 1)


def test_an_estimate_records_its_flop_counting_steps_modelled_time(monkeypatch):
    import harness.estimate.loop as loop
    from harness.estimate import estimate_cell
    from harness.spec.cell import Cell, ModelSpec

    seen = []

    class Recorded(RooflineTimer):
        def __exit__(self, *exc):
            seen.append((self.seconds, self.bytes))
            return super().__exit__(*exc)

    monkeypatch.setattr(loop, "RooflineTimer", Recorded)
    tiny = {"dim": 32, "n_layers": 2, "n_heads": 2, "vocab_size": 64}
    model = ModelSpec(name="llama3:debugmodel", overrides=tiny)
    cell = Cell(spec="t", model=model, prefix_len=96, suffix_len=16, n=4, dtype="bf16", warmup=0, repeats=1,
                device="cpu")  # fmt: skip
    base, pf = estimate_cell(cell)
    assert [(r["modelled_time_s"], r["modelled_bytes"]) for r in (base, pf)] == seen
    for r in (base, pf):
        bound = max(r["counted_flops"] / H20_BF16_FLOPS, r["modelled_bytes"] / H20_HBM_BYTES)
        assert r["modelled_time_s"] >= bound * (1 - 1e-12)  # a sum of maxima is at least the max of the sums
    assert pf["modelled_time_s"] < base["modelled_time_s"]  # the shared prefix runs once
