"""Nothing of PrefixFlow survives a group: no cache, leaf, accumulator, hook, mode or retained graph."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import tiny_model
from support.live_tensors import live_tensor_bytes
from support.reference import max_rel_diff, reference_pg

import prefixflow as pf
import prefixflow.schedule.stage as stage_module
import prefixflow.state.kv_cache as kv_cache


@pytest.fixture
def tracked_caches(monkeypatch):
    refs: list[weakref.ref] = []
    original = kv_cache.PrefixKVCache.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        refs.append(weakref.ref(self))

    monkeypatch.setattr(kv_cache.PrefixKVCache, "__init__", init)
    return refs


def assert_clean(model, refs):
    gc.collect()
    assert model._prefixflow.state.mode is None
    assert all(r() is None for r in refs), "a PrefixKVCache outlived its group"
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    for p in model.parameters():
        assert not p._backward_hooks and not getattr(p, "_post_accumulate_grad_hooks", None)
        assert p.grad is None or p.grad.grad_fn is None


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_repeated_groups_leave_no_state(family, layout, tracked_caches):
    model = tiny_model(family, ac="selective")
    groups = [pf.synthetic_group(97, 12 + k, [3, 5, 2], seed=k) for k in range(4)]
    pf.train_group(model, groups[0], layout=layout)  # warm: grads allocated
    before = live_tensor_bytes()
    for group in groups[1:]:
        pf.train_group(model, group, layout=layout, microbatch=2)
    assert live_tensor_bytes() == before
    assert len(tracked_caches) == 4
    assert_clean(model, tracked_caches)


def test_exception_mid_phase_b_releases_everything(family, monkeypatch, tracked_caches):
    model = tiny_model(family)
    group = pf.synthetic_group(97, 9, [4, 2, 3], seed=1)
    calls = {"n": 0}
    real = stage_module.microbatch_objective

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure in the second suffix microbatch")
        return real(*args, **kwargs)

    monkeypatch.setattr(stage_module, "microbatch_objective", flaky)
    with pytest.raises(RuntimeError, match="injected failure"):
        pf.train_group(model, group, microbatch=1)
    assert_clean(model, tracked_caches)
    monkeypatch.setattr(stage_module, "microbatch_objective", real)
    # The model is usable again and still exact.
    want_loss, want = reference_pg(model, group)
    model.zero_grad(set_to_none=True)
    stats = pf.train_group(model, group, microbatch=1)
    assert abs(stats.loss - want_loss) < 1e-12
    assert max_rel_diff([p.grad for p in model.parameters()], want) <= 1e-9


def test_phase_times_and_observer_calls(family):
    model = tiny_model(family)
    events = []

    class Recorder:
        def enter(self, phase):
            events.append(("enter", phase))

        def exit(self, phase):
            events.append(("exit", phase))

    group = pf.synthetic_group(97, 10, [3, 4], seed=2)
    stats = pf.train_group(model, group, observer=Recorder())
    assert events == [
        ("enter", "A"),
        ("exit", "A"),
        ("enter", "B"),
        ("exit", "B"),
        ("enter", "C"),
        ("exit", "C"),
    ]
    assert set(stats.phase_times) == {"A", "B", "C"} and all(t > 0 for t in stats.phase_times.values())
    assert stats.prefix_tokens == 9 and stats.suffix_tokens == 7 and stats.n_microbatches == 1
    events.clear()
    base = pf.train_group(model, group, system="baseline", microbatch=1, observer=Recorder())
    assert events == [("enter", "full"), ("exit", "full")]
    assert base.n_microbatches == 2 and base.trunk_tokens == (10 + 2) + (10 + 3)
