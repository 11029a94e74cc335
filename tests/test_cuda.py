"""CUDA-only checks (run by `make gpu-check` on a machine with a GPU; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch
from _reference import max_rel_diff
from conftest import TINY

import prefixflow as pf

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def cuda_model(family: str, dtype=torch.float32, **config):
    name, overrides = TINY[family]
    model = pf.build_model(name, dtype=dtype, overrides=overrides, device="cuda")
    return pf.apply_prefixflow(model, pf.PrefixFlowConfig(**config))


def grads_of(model, group, **kwargs):
    model.zero_grad(set_to_none=True)
    stats = pf.train_group(model, group, **kwargs)
    return stats, [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("family", sorted(TINY))
def test_prefixflow_matches_baseline_on_cuda(family):
    model = cuda_model(family)
    group = pf.synthetic_group(97, 40, [7, 12, 3, 9], seed=0)
    _, want = grads_of(model, group, system="baseline")
    for layout in ("padded", "packed"):
        stats, got = grads_of(model, group, layout=layout, microbatch=2)
        assert max_rel_diff(got, want) < 1e-4
        assert set(stats.phase_times) == {"A", "B", "C"}


@pytest.mark.parametrize("prefetch", [True, False])
def test_pinned_pool_offload_is_bitwise_and_released(prefetch):
    plain = cuda_model("llama3")
    group = pf.synthetic_group(97, 200, [30, 50, 20], seed=1)
    _, want = grads_of(plain, group)
    model = cuda_model("llama3", offload=True, offload_prefetch=prefetch)
    stats, got = grads_of(model, group)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    off = stats.offload
    assert off.tier == "cuda-pinned" and off.offloaded_bytes > 0
    assert off.offloaded_bytes == off.prefetched_bytes + off.demand_loaded_bytes + off.dropped_bytes
    assert off.released


def test_phase_b_peak_drops_with_offload_on_cuda():
    from harness.measure import PhaseMeter

    group = pf.synthetic_group(97, 1000, [100] * 4, seed=2)
    peaks = {}
    for offload in (False, True):
        model = cuda_model("llama3", offload=offload)
        pf.train_group(model, group)  # warm: grads allocated
        meter = PhaseMeter("cuda")
        pf.train_group(model, group, observer=meter)
        peaks[offload] = meter.results()["peak_mem_phase_b_bytes"]
        del model
        torch.cuda.empty_cache()
    assert peaks[True] < peaks[False]
