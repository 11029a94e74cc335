"""Offload of dormant prefix saved tensors (prefixflow.memory.offload): bitwise-neutral, real, and released."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from conftest import tiny_model

import prefixflow as pf
import prefixflow.schedule.stage as stage_module
from prefixflow.group import synthetic_group
from prefixflow.memory.live_bytes import LiveBytesMeter
from prefixflow.memory.offload import TIER_CPU

MODES = {
    "off": pf.PrefixFlowConfig(),
    "prefetch": pf.PrefixFlowConfig(offload=True),
    "demand": pf.PrefixFlowConfig(offload=True, offload_prefetch=False),
}


def run(model, group, mode: str, **kwargs):
    pf.apply_prefixflow(model, MODES[mode])
    model.zero_grad(set_to_none=True)
    stats = pf.train_group(model, group, **kwargs)
    return stats, [p.grad.clone() for p in model.parameters()]


def pool_fds() -> list[str]:
    """Open file descriptors of this process that point at an offload pool file."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "prefixflow-offload-" in target:
            found.append(target)
    return found


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_gradients_bitwise_equal_with_prefetch_and_demand_load(family, ac, layout):
    model = tiny_model(family, ac=ac)
    group = synthetic_group(97, 40, [5, 9, 3, 7], seed=1)
    want_stats, want = run(model, group, "off", layout=layout, microbatch=2)
    assert want_stats.offload is None
    for mode in ("prefetch", "demand"):
        stats, got = run(model, group, mode, layout=layout, microbatch=2)
        assert stats.loss == want_stats.loss
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), mode
        off = stats.offload
        assert off.tier == TIER_CPU and off.released
        assert off.offloaded_bytes > 0
        # Every offloaded byte came back exactly once, except what autograd freed unneeded.
        assert off.loaded_bytes == off.offloaded_bytes - off.dropped_bytes > 0
        assert 0 <= off.late_bytes <= off.prefetched_bytes
        if mode == "prefetch":
            assert off.prefetched_bytes > 0
        else:
            assert off.prefetched_bytes == 0 and off.demand_loaded_bytes == off.loaded_bytes
        if ac == "none":
            # K and V of layer 0 stayed resident (Phase A stops right after capturing the last layer's,
            # so no op saves those)
            assert off.kept.get("kv", 0) >= 2
    assert not pool_fds()


def test_one_slot_per_storage_exact_views_and_resident_kinds():
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(64, 64, dtype=torch.float64))
    x = torch.randn(32, 64, dtype=torch.float64, requires_grad=True)
    tiny = torch.randn(4, dtype=torch.float64, requires_grad=True)

    def forward():
        h = x * 2
        y = h.sin().sum() + h[:, 3:].t().cos().sum() + h.exp().exp().sum()  # h saved twice, as two views
        return (
            y
            + model.w.sin().sum()
            + tiny.sin().sum()
            + h.gather(1, torch.zeros(32, 1, dtype=torch.long)).sum()
        )

    forward().backward()
    want = [t.grad.clone() for t in (x, tiny, model.w)]
    for t in (x, tiny, model.w):
        t.grad = None
    for prefetch in (True, False):
        off = pf.PrefixOffload(model, pf.PrefixKVCache(), prefetch=prefetch)
        with off.saving():
            loss = forward()
        assert len(pool_fds()) == 1
        off.prefetch()
        loss.backward()
        del loss
        off.release()
        got = [t.grad.clone() for t in (x, tiny, model.w)]
        for t in (x, tiny, model.w):
            t.grad = None
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        s = off.stats
        # h (one storage, saved by sin, the strided view and gather) and the two exp outputs: three slots.
        assert s.offloaded_tensors == 3 and s.offloaded_bytes == 3 * 32 * 64 * 8
        assert s.kept == {"param": 1, "small": 1, "non_float": 1}
        assert s.loaded_bytes == s.offloaded_bytes and s.dropped_bytes == 0
        assert (s.prefetched_bytes > 0) == prefetch
        assert not pool_fds()


def test_pool_exists_during_phase_b_and_is_gone_after_the_group():
    model = tiny_model("llama3")
    group = synthetic_group(97, 40, [6, 6, 6], seed=3)
    pf.apply_prefixflow(model, MODES["prefetch"])
    during = {}

    class Probe:
        def enter(self, phase):
            if phase == "B":
                during["fds"] = pool_fds()

        def exit(self, phase):
            pass

    stats = pf.train_group(model, group, observer=Probe())
    assert len(during["fds"]) == 1 and during["fds"][0].endswith("(deleted)")  # unlinked, still open
    assert not pool_fds() and stats.offload.released
    assert stats.offload.pool_capacity_bytes == stats.offload.offloaded_bytes


def test_pool_released_after_an_exception_mid_phase_b(monkeypatch):
    model = tiny_model("qwen3")
    group = synthetic_group(97, 40, [5, 7, 4], seed=4)
    _, want = run(model, group, "off", microbatch=1)
    real = stage_module.microbatch_objective
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom in the second suffix microbatch")
        return real(*args, **kwargs)

    monkeypatch.setattr(stage_module, "microbatch_objective", failing)
    pf.apply_prefixflow(model, MODES["prefetch"])
    with pytest.raises(RuntimeError, match="boom"):
        pf.train_group(model, group, microbatch=1)
    assert not pool_fds()
    monkeypatch.setattr(stage_module, "microbatch_objective", real)
    _, got = run(model, group, "demand", microbatch=1)  # the next group is unaffected
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


class PhaseLive:
    """Observer: live bytes when each phase starts and its peak (LiveBytesMeter)."""

    def __init__(self, meter: LiveBytesMeter) -> None:
        self.meter, self.start, self.peak = meter, {}, {}

    def enter(self, phase):
        self.start[phase] = self.meter.current
        self.meter.reset_peak()

    def exit(self, phase):
        self.peak[phase] = self.meter.peak


def measure(model, group, mode: str):
    pf.apply_prefixflow(model, MODES[mode])
    model.zero_grad(set_to_none=True)
    meter = LiveBytesMeter()
    meter.register(model)
    probe = PhaseLive(meter)
    before = meter.current
    with meter:
        stats = pf.train_group(model, group, observer=probe)
    grads = sum(p.grad.untyped_storage().nbytes() for p in model.parameters())
    probe.residual = meter.current - before - grads  # bytes a group leaves behind besides .grad
    return stats, probe


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_phase_b_live_bytes_drop_by_the_offloaded_bytes(ac):
    model = tiny_model("llama3", dtype=torch.float32, ac=ac)
    group = synthetic_group(97, 121, [24] * 4, seed=5)  # prefix ratio 5/6
    _, base = measure(model, group, "off")
    stats, off = measure(model, group, "prefetch")
    o = stats.offload
    resident_saved = o.offloaded_bytes - o.dropped_bytes
    assert resident_saved > 0
    # Phase B starts exactly the offloaded (and still needed) bytes lower, and peaks lower.
    assert base.start["B"] - off.start["B"] == resident_saved
    assert off.peak["B"] <= base.peak["B"] - resident_saved
    assert off.peak["B"] < base.peak["B"]
    assert off.residual == base.residual  # offload leaves nothing behind


def test_selective_ac_cache_leaves_like_everything_else():
    """Op-level SAC keeps its saved op outputs in a cache of its own, outside autograd's saved-tensor hooks:
    offload routes it through the same slots, so Phase B under SAC starts from what full AC leaves (the K/V
    and the parameters), and the Phase-B peak drops by more than the block inputs."""
    group = synthetic_group(97, 121, [24] * 4, seed=5)  # prefix ratio 5/6
    starts, peaks, moved = {}, {}, {}
    for ac in ("full", "selective"):
        model = tiny_model("llama3", dtype=torch.float32, ac=ac)
        _, base = measure(model, group, "off")
        stats, off = measure(model, group, "prefetch")
        starts[ac], peaks[ac], moved[ac] = off.start["B"], (base.peak["B"], off.peak["B"]), stats.offload
    assert starts["selective"] == starts["full"]
    assert (
        moved["selective"].offloaded_bytes > 4 * moved["full"].offloaded_bytes
    )  # more than the block inputs
    sac_base, sac_off = peaks["selective"]
    assert sac_base - sac_off >= moved["selective"].offloaded_bytes - moved["selective"].dropped_bytes


def test_config_rejects_non_bool_offload_flags():
    with pytest.raises(TypeError, match="offload"):
        pf.PrefixFlowConfig(offload=1)
    with pytest.raises(TypeError, match="offload_prefetch"):
        pf.PrefixFlowConfig(offload=True, offload_prefetch="yes")


def _inplace_after_save(offload, modify):
    """x -> y = exp(x) (saves y) -> z = y * w (saves y, w) -> optional in-place change of y -> backward."""
    torch.manual_seed(0)
    x = torch.randn(64, 64, dtype=torch.float64, requires_grad=True)
    w = torch.randn(64, 64, dtype=torch.float64, requires_grad=True)
    with offload.saving() if offload is not None else contextlib.nullcontext():
        y = x.exp()
        z = y * w
        if modify:
            y.view(-1)[:10].add_(1.0)  # through a view: the version counter is shared
    z.sum().backward()
    return x.grad, w.grad


@pytest.mark.parametrize("min_bytes", [0, 1 << 30])  # offloaded / kept resident
def test_inplace_change_to_a_saved_tensor_raises_like_autograd(min_bytes):
    """Autograd raises when a saved tensor is modified in place; saved-tensor hooks switch that check off, so
    the offload must do it (for offloaded and for resident tensors), not hand Phase C stale or torn bytes."""
    from prefixflow.memory.offload import PrefixOffload
    from prefixflow.state.kv_cache import PrefixKVCache

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _inplace_after_save(None, modify=True)  # plain autograd
    module = torch.nn.Linear(2, 2)
    want = _inplace_after_save(None, modify=False)
    off = PrefixOffload(module, PrefixKVCache(), min_bytes=min_bytes)
    try:
        got = _inplace_after_save(off, modify=False)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))  # no change: no error, exact
        assert (off.stats.offloaded_bytes > 0) == (min_bytes == 0)
    finally:
        off.release()
    off = PrefixOffload(module, PrefixKVCache(), min_bytes=min_bytes)
    try:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            _inplace_after_save(off, modify=True)
    finally:
        off.release()


def _dtensor_after_save(offload, modify: str | None):
    """As ``_inplace_after_save`` on DTensors sharded over a fake 2-rank mesh (the shard's math is real)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    x = distribute_tensor(torch.randn(128, 64, dtype=torch.float64), mesh, [Shard(0)]).requires_grad_()
    w = distribute_tensor(torch.randn(128, 64, dtype=torch.float64), mesh, [Shard(0)]).requires_grad_()
    with offload.saving() if offload is not None else contextlib.nullcontext():
        y = x.exp()
        z = y * w
        if modify == "wrapper":
            y.add_(1.0)  # bumps the DTensor's counter, not its shard's
        elif modify == "shard":
            y.to_local().detach().view(-1)[:10].add_(1.0)  # bumps the shard's counter, not the DTensor's
    z.to_local().sum().backward()
    return x.grad.to_local(), w.grad.to_local()


@pytest.mark.parametrize("modify", [None, "wrapper", "shard"])
def test_a_dtensor_moves_by_its_local_shard_and_in_place_changes_still_raise(modify):
    """TP and FSDP2 save DTensors: the offload moves their local shard (they stayed resident once, so TP's
    offload moved almost nothing) and rebuilds the wrapper; an in-place change through either raises."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from prefixflow.memory.offload import PrefixOffload
    from prefixflow.state.kv_cache import PrefixKVCache

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        want = _dtensor_after_save(None, None)
        off = PrefixOffload(torch.nn.Linear(2, 2), PrefixKVCache(), min_bytes=0)
        try:
            if modify is not None:
                with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                    _dtensor_after_save(off, modify)
                return
            got = _dtensor_after_save(off, None)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            assert "subclass" not in off.stats.kept
            assert off.stats.offloaded_bytes >= 2 * 64 * 64 * 8  # y and w's shards (x's exp output is y)
        finally:
            off.release()
    finally:
        dist.destroy_process_group()
