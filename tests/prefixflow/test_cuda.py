"""CUDA-only checks (run by `make gpu-check` on a machine with a GPU; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY
from support.reference import max_rel_diff

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


@pytest.mark.parametrize("prefetch", [True, False])
def test_pinned_pool_copies_run_on_its_streams_and_survive_slow_copies(prefetch, monkeypatch):
    """Each copy out (and each prefetch) is queued on the pool's own stream behind a spin of about a
    millisecond, so the default stream runs far ahead: the sources are freed and their blocks handed out
    again while their copies wait, and Phase C's backward is queued before its loads land. The gradients
    still equal the run without offload bit for bit: record_stream keeps each source until its copy, and
    the copy-out and load events order every read after its write."""
    from prefixflow.memory.storage import PinnedPool

    spun = {"out": 0, "in": 0}
    store, start_load = PinnedPool.store, PinnedPool.start_load

    def spin(pool, stream, key):
        assert stream != torch.cuda.current_stream(pool.device)  # a side stream, not the caller's
        with torch.cuda.stream(stream):
            torch.cuda._sleep(2_000_000)
        spun[key] += 1

    def slow_store(pool, slot, src):
        spin(pool, pool.out_stream, "out")
        store(pool, slot, src)

    def slow_load(pool, slot):
        spin(pool, pool.in_stream, "in")
        start_load(pool, slot)

    monkeypatch.setattr(PinnedPool, "store", slow_store)
    monkeypatch.setattr(PinnedPool, "start_load", slow_load)
    plain = cuda_model("llama3")
    group = pf.synthetic_group(97, 300, [40, 60, 20], seed=3)
    _, want = grads_of(plain, group)
    model = cuda_model("llama3", offload=True, offload_prefetch=prefetch)
    stats, got = grads_of(model, group)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert spun["out"] > 0 and (spun["in"] > 0) == prefetch, spun
    assert stats.offload.tier == "cuda-pinned" and stats.offload.released


def test_phase_b_peak_drops_with_offload_on_cuda():
    from harness.run.measure import PhaseMeter

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


def _split_inputs(dtype, heads, kv_heads, b=3, s=37, p=50, d=64, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=dtype).requires_grad_(True)

    return (
        rand(b, heads, s, d),
        rand(b, kv_heads, s, d),
        rand(b, kv_heads, s, d),
        rand(1, kv_heads, p, d),
        rand(1, kv_heads, p, d),
    )


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize(
    "dtype,backend,causal",
    [
        (torch.bfloat16, "FLASH_ATTENTION", True),
        (torch.float16, "FLASH_ATTENTION", True),
        (torch.float32, "EFFICIENT_ATTENTION", True),
        (torch.bfloat16, "EFFICIENT_ATTENTION", False),
        (torch.float32, "EFFICIENT_ATTENTION", False),
    ],
)
def test_split_fused_cuda_kernels_match_the_reference(dtype, backend, causal, heads, kv_heads, monkeypatch):
    """The fused CUDA path of split attention (flash / memory-efficient SDPA with their log-sum-exp) gives the
    reference's output and gradients for q, k, v and the cached prefix K/V; the fused kernel really ran."""
    from torch.nn.attention import SDPBackend

    import prefixflow.attention.split as sa

    backends = [getattr(SDPBackend, backend)]
    q, k, v, pk, pv = _split_inputs(dtype, heads, kv_heads)
    mask = torch.ones(37, 37, dtype=torch.bool, device="cuda").tril().expand(3, 1, 37, 37).clone()
    if not causal:  # packed-like holes; every row keeps its diagonal
        mask[0, 0, 20:, :10] = False
    prepared = sa.suffix_bias(mask, dtype, causal=causal)
    used = []
    real = sa._attend
    monkeypatch.setattr(sa, "_attend", lambda name, *a: used.append(name) or real(name, *a))
    out = sa.split_attention(q, k, v, pk, pv, mask, prepared=prepared, backends=backends)
    assert len(used) == 2 and all(n.startswith(backend.split("_")[0].lower()) for n in used), used
    want = sa.split_attention_reference(q, k, v, pk, pv, mask)
    tol = 2e-2 if dtype != torch.float32 else 2e-3
    grad = torch.randn_like(out)
    got_g = torch.autograd.grad(out, (q, k, v, pk, pv), grad)
    want_g = torch.autograd.grad(want, (q, k, v, pk, pv), grad)
    assert max_rel_diff([out.float()], [want.float()]) < tol
    assert max_rel_diff([g.float() for g in got_g], [w.float() for w in want_g]) < tol


def test_split_on_cuda_bf16_model_uses_the_fused_kernel_and_matches_the_baseline(monkeypatch):
    import prefixflow.attention.split as sa

    used = []
    real = sa._attend
    monkeypatch.setattr(sa, "_attend", lambda name, *a: used.append(name) or real(name, *a))
    name, overrides = TINY["llama3"]
    model = pf.build_model(name, dtype=torch.bfloat16, overrides={**overrides, "dim": 128}, device="cuda")
    pf.apply_prefixflow(model, pf.PrefixFlowConfig(attention="split"))
    group = pf.synthetic_group(97, 40, [7, 12, 3, 9], seed=0)
    _, want = grads_of(model, group, system="baseline")
    _, got = grads_of(model, group, layout="padded", microbatch=2)
    assert used and all(n.startswith("flash") for n in used), used
    assert max_rel_diff([g.float() for g in got], [w.float() for w in want]) < 5e-2
