"""Offload of the dormant prefix activations of recurrent layers (gated DeltaNet, Mamba-2): bitwise neutral.

During Phase B only the cached boundary (K/V, recurrent state, conv tail) is hot; everything else the prefix
graph saved, the recurrent layers' projections, convolution inputs and chunk-kernel intermediates included,
moves to the offload tier and comes back for Phase C. Gradients and loss must be bitwise equal to no offload.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from support.hybrid import VERIFIED_TRANSFORMERS, VOCAB, nemotron_h, qwen3_5  # noqa: E402

import prefixflow as pf  # noqa: E402
from prefixflow.integrations import hf  # noqa: E402,F401

pytestmark = VERIFIED_TRANSFORMERS

LIN, FULL = "linear_attention", "full_attention"
FAMILIES = {"qwen3_5": (qwen3_5, (LIN, FULL, LIN)), "nemotron_h": (nemotron_h, (LIN, FULL, "mlp"))}
GROUP = pf.synthetic_group(VOCAB, 21, [5, 9, 1, 7], seed=3)


def _run(name, config, layout, ac="none"):
    family, types = FAMILIES[name]
    model = family(types)
    pf.apply_ac(model, ac)
    pf.apply_prefixflow(model, config)
    stats = pf.train_group(model, GROUP, layout=layout, microbatch=2)
    return stats, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_offload_bitwise(name, layout, prefetch, ac):
    """Offload on vs off, with and without HF's activation checkpointing (which leaves only the checkpointed
    blocks' inputs to offload)."""
    want_stats, want = _run(name, None, layout, ac)
    stats, got = _run(name, pf.PrefixFlowConfig(offload=True, offload_prefetch=prefetch), layout, ac)
    assert stats.loss == want_stats.loss
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    off = stats.offload
    assert off.released and off.offloaded_bytes > 0
    assert off.loaded_bytes == off.offloaded_bytes - off.dropped_bytes > 0


def test_offload_fault_is_seen(monkeypatch):
    """The bitwise check catches one flipped bit in every tensor read back from the offload file."""
    from prefixflow.memory.storage import FilePool

    original = FilePool._read

    def corrupt(self, dst, offset):
        original(self, dst, offset)
        dst.view(torch.uint8)[0] ^= 1  # lowest mantissa bit of the first element

    _, want = _run("qwen3_5", None, "packed")
    monkeypatch.setattr(FilePool, "_read", corrupt)
    _, got = _run("qwen3_5", pf.PrefixFlowConfig(offload=True), "packed")
    assert not all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


class _PhaseLive:
    """Observer: live bytes when each phase starts and its peak."""

    def __init__(self, meter) -> None:
        self.meter, self.start, self.peak = meter, {}, {}

    def enter(self, phase):
        self.start[phase] = self.meter.current
        self.meter.reset_peak()

    def exit(self, phase):
        self.peak[phase] = self.meter.peak


def _measure(name, config):
    from prefixflow.memory.live_bytes import LiveBytesMeter

    family, types = FAMILIES[name]
    model = family(types, dtype=torch.float32)
    pf.apply_prefixflow(model, config)
    meter = LiveBytesMeter()
    meter.register(model)
    probe = _PhaseLive(meter)
    with meter:
        stats = pf.train_group(model, GROUP, layout="packed", microbatch=1, observer=probe)
    return stats, probe


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_phase_b_live_bytes_drop_by_the_offloaded_bytes(name):
    """The recurrent layers' dormant prefix activations really leave device memory for Phase B."""
    _, base = _measure(name, None)
    stats, off = _measure(name, pf.PrefixFlowConfig(offload=True))
    resident_saved = stats.offload.offloaded_bytes - stats.offload.dropped_bytes
    assert resident_saved > 0
    assert base.start["B"] - off.start["B"] == resident_saved
    assert off.peak["B"] < base.peak["B"]
