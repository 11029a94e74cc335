"""harness.run.measure: the CPU live-bytes meter, the phase observer and rank-max."""

from __future__ import annotations

import gc
import math
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness.run.measure import PhaseMeter, rank_max
from prefixflow.memory.live_bytes import LiveBytesMeter

MIB4 = 1024 * 1024 * 4  # 1024 x 1024 fp32


def test_known_allocation_is_exact_and_free_is_tracked():
    meter = LiveBytesMeter()
    with meter:
        x = torch.empty(1024, 1024)
        assert meter.current == MIB4
        assert meter.peak == MIB4
        del x
        gc.collect()
        assert meter.current == 0
    assert meter.peak == MIB4


def test_views_are_not_double_counted_and_peak_differs_from_current():
    meter = LiveBytesMeter()
    with meter:
        a = torch.empty(1024, 1024)
        v = a[:10].view(-1)  # a view shares the storage
        b = torch.empty(2048, 1024)
        del b
        assert meter.current == MIB4
        assert meter.peak == 3 * MIB4
        meter.reset_peak()
        assert meter.peak == MIB4
        del a, v


def test_autograd_saved_tensors_and_grads_are_counted():
    w = torch.randn(256, 256, requires_grad=True)
    meter = LiveBytesMeter()
    assert meter.register([w]) == 256 * 256 * 4
    assert meter.register([w]) == 0  # registering twice counts once
    with meter:
        x = torch.randn(64, 256)  # 64 KiB input
        h = (x @ w).tanh()  # tanh saves its output; matmul saves x and w
        loss = h.sum()
        after_fwd = meter.current
        # w (256 KiB) + x (64 KiB) + x@w (64 KiB, freed only when h is freed? no: a temporary) + h + loss
        assert after_fwd >= 256 * 256 * 4 + 2 * 64 * 256 * 4
        loss.backward()
        assert w.grad is not None
    # the grad storage was created under the mode, so it is live now
    assert meter.current >= 256 * 256 * 4 * 2
    assert meter.peak >= meter.current


def test_register_module_counts_parameters_buffers():
    lin = torch.nn.Linear(128, 64)
    bn = torch.nn.BatchNorm1d(64)
    model = torch.nn.Sequential(lin, bn)
    meter = LiveBytesMeter()
    n = meter.register(model)
    expect = sum(p.numel() * 4 for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    assert n == expect == meter.current


def test_exclude_and_offload_scope_separate_offloaded_bytes():
    meter = LiveBytesMeter()
    with meter:
        a = torch.empty(1024, 1024)
        assert meter.exclude(a) == MIB4
        assert meter.exclude(a) == 0
        assert meter.current == 0 and meter.offloaded == MIB4
        assert meter.is_offloaded(a)
        with meter.offload_scope():
            pool = torch.empty(2 * 1024 * 1024)  # 8 MiB host pool
        assert meter.offloaded == 3 * MIB4 and meter.current == 0
        b = torch.empty(1024, 1024)
        assert meter.current == MIB4
        del a, pool
        gc.collect()
        assert meter.offloaded == 0 and meter.offloaded_peak == 3 * MIB4
        del b


def test_phase_peaks_are_separate():
    pm = PhaseMeter("cpu")
    pm.enter("A")
    a = torch.empty(1024, 1024)
    pm.exit("A")
    pm.enter("B")
    big = torch.empty(4096, 1024)  # 16 MiB only in B
    del big
    pm.exit("B")
    pm.enter("C")
    del a
    pm.exit("C")
    res = pm.results(extended=True)
    assert res["phase_peak_bytes"]["A"] == MIB4
    assert res["peak_mem_phase_b_bytes"] == MIB4 + 4 * MIB4  # a is live in B, plus the 16 MiB
    assert res["phase_peak_bytes"]["C"] == MIB4
    assert res["peak_mem_bytes"] == 5 * MIB4
    assert res["mem_meter"] == "cpu-live-bytes"


def test_storages_another_thread_frees_are_counted_as_freed_late():
    # A gloo worker dropping a collective's buffer after the main thread let go of it: the storage dies there
    pm = PhaseMeter("cpu")
    pm.enter("B")
    here, there = torch.empty(1024, 1024), [torch.empty(2048, 1024)]
    del here  # dies on this thread: not late
    worker = threading.Thread(target=there.clear)
    worker.start()
    worker.join()
    pm.exit("B")
    res = pm.results(extended=True)
    assert res["foreign_freed_bytes"] == 2 * MIB4
    assert pm.live.current == 0
    pm.reset()  # a new step counts from here
    assert pm.results(extended=True)["foreign_freed_bytes"] == 0


def test_phase_meter_counts_registered_model_and_outer_context():
    model = torch.nn.Linear(1024, 1024, bias=False)
    pm = PhaseMeter("cpu", model=model)
    with pm:
        pm.enter("full")
        y = model(torch.ones(1, 1024))
        pm.exit("full")
        between = torch.empty(1024, 1024)  # seen because the outer context is active
        assert pm.live.current >= 2 * MIB4
        del between, y
    res = pm.results()
    assert res["peak_mem_bytes"] >= MIB4 + 1024 * 4
    # baseline contract: no A/B/C phases -> NaN times, phase-B peak is the whole-step peak
    assert math.isnan(res["phase_a_s"]) and math.isnan(res["phase_b_s"]) and math.isnan(res["phase_c_s"])
    assert res["peak_mem_phase_b_bytes"] == res["peak_mem_bytes"]


def test_cpu_timing_is_sane():
    pm = PhaseMeter("cpu")
    for phase, dur in (("A", 0.02), ("B", 0.05), ("C", 0.01)):
        pm.enter(phase)
        time.sleep(dur)
        pm.exit(phase)
    res = pm.results()
    assert 0.018 <= res["phase_a_s"] < 0.2
    assert 0.048 <= res["phase_b_s"] < 0.3
    assert 0.009 <= res["phase_c_s"] < 0.2
    total = res["phase_a_s"] + res["phase_b_s"] + res["phase_c_s"]
    assert total <= res["step_time_s"] < total + 0.05
    pm.reset()
    assert math.isnan(pm.results()["step_time_s"])


def test_phase_misuse_raises():
    pm = PhaseMeter("cpu")
    with pytest.raises(RuntimeError):
        pm.exit("A")
    pm.enter("A")
    with pytest.raises(RuntimeError):
        pm.enter("A")
    with pytest.raises(RuntimeError):
        pm.results()
    pm.exit("A")


def test_rank_max_identity_when_not_distributed():
    d = {"step_time_s": 1.5, "mem_meter": "cpu-live-bytes"}
    assert rank_max(d) == d


def _worker(rank: int, world: int, store: str, q) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # a file store and loopback pairs: nothing listens outside
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        d = {
            "t": float(rank + 1),
            "m": 10.0 - rank,
            "n": math.nan if rank == 0 else 3.0,
            "all_nan": math.nan,
            "meter": "cpu-live-bytes",
        }
        q.put((rank, rank_max(d)))
    finally:
        dist.destroy_process_group()


def test_rank_max_gloo_two_processes(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    store = str(tmp_path / "store")
    mp.start_processes(_worker, args=(2, store, q), nprocs=2, join=True, start_method="spawn")
    results = dict(q.get() for _ in range(2))
    for rank in (0, 1):
        r = results[rank]
        assert r["t"] == 2.0 and r["m"] == 10.0 and r["n"] == 3.0
        assert math.isnan(r["all_nan"]) and r["meter"] == "cpu-live-bytes"


def test_timing_only_mode_skips_memory():
    pm = PhaseMeter("cpu", track_memory=False)
    assert pm.live is None and pm.mem_meter == "none"
    pm.enter("full")
    torch.empty(1024, 1024)
    pm.exit("full")
    res = pm.results(extended=True)
    assert math.isnan(res["peak_mem_bytes"]) and math.isnan(res["peak_mem_phase_b_bytes"])
    assert res["step_time_s"] > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_phase_meter_events_and_max_allocated():
    pm = PhaseMeter("cuda")
    keep = torch.empty(1024, 1024, device="cuda")
    pm.enter("A")
    a = torch.empty(1024, 1024, device="cuda")
    pm.exit("A")
    pm.enter("B")
    big = torch.empty(4096, 1024, device="cuda")
    del big
    pm.exit("B")
    pm.enter("C")
    torch.cuda._sleep(1_000_000)
    pm.exit("C")
    res = pm.results(extended=True)
    assert res["mem_meter"] == "cuda-max-allocated"
    assert res["phase_peak_bytes"]["B"] - res["phase_peak_bytes"]["A"] >= 4 * MIB4
    assert res["phase_c_s"] > 0 and res["step_time_s"] >= res["phase_c_s"]
    del a, keep


def test_a_storage_freed_by_gc_while_the_meter_holds_its_lock_does_not_deadlock():
    # An allocation inside the meter's locked section can run the GC, whose finalizers free other tracked
    # storages and re-enter the meter (a pf-bench MoE cell hung there forever with a plain Lock).
    meter = LiveBytesMeter("cpu")  # the one meter: PhaseMeter's and microbatch="auto"'s
    with meter:
        t = torch.empty(1000, dtype=torch.float64)
    cycle = [t]
    cycle.append(cycle)  # only the GC frees it
    del t
    before = meter.current
    done = threading.Event()

    def collect_under_the_lock():
        with meter._lock:
            gc.collect()
        done.set()

    gc.disable()  # the cycle must die in the collect below, not earlier
    try:
        del cycle
        th = threading.Thread(target=collect_under_the_lock, daemon=True)
        th.start()
        th.join(timeout=20)
    finally:
        gc.enable()
    assert done.is_set(), "the meter deadlocked on its own lock"
    assert before - meter.current == 8000
