"""Parallel layouts estimated on torch's fake process group (``harness.estimate.world``).

- Fake equals real: TP2, CP2 (selective AC, with and without offload), FSDP2 and PP2, the baseline and
  PrefixFlow; each phase's peak on each rank within max(1%, 64 KiB) of two real gloo ranks' (one launch).
  TP, CP and FSDP2 hold it; PP does not yet (``OPEN``).
- The chosen ranks: on TP2×CP2×PP2 every rank runs, each rank's per-phase peaks equal those of the rank that
  stands for it, and the chosen ranks' maxima equal all ranks'.
"""

from __future__ import annotations

import json

import pytest
from support.estimate_layouts import LAYOUTS, TINY, layout_cell
from support.torchrun_cases import launch_worker

from harness.estimate.world import chosen_ranks, estimate_layout, estimate_ranks, representatives
from harness.spec.cell import Cell

SYSTEMS = ("baseline", "prefixflow")


def _tolerance(real: float) -> float:
    return max(0.01 * real, 64 * 1024)


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    out = tmp_path_factory.mktemp("estimate-layouts") / "real.json"
    return launch_worker("support.estimate_layout_worker", 2, [str(out)], out, timeout=600)


def _largest_unit_grad_bytes(cell: Cell) -> int:
    """The largest FSDP2 unit's gradient bytes (a block, or the embedding with the head): what one
    reduce-scatter in flight holds."""
    import torch

    from harness.run.setup import build_cell_model

    with torch.device("meta"):
        model = build_cell_model(cell, torch.device("meta"))
    units: dict[str, int] = {}
    for name, p in model.named_parameters():
        unit = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "rest"
        units[unit] = units.get(unit, 0) + p.numel() * p.element_size()
    return max(units.values())


def _peaks(per_rank: list[list[dict]]) -> list[dict[str, dict[str, float]]]:
    return [{rec["system"]: rec["memory"]["phase_peak_bytes"] for rec in rows} for rows in per_rank]


# Open gap (docs/estimate.md, "Layouts"): under PP the fake run is up to 6.9% above the real one. Strict: once
# it closes, this fails and the mark must go.
OPEN = {"pp2": "PP: fake peaks up to 754 KB (6.9%) above the real gloo ranks'"}
CASES = [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=OPEN[n])) if n in OPEN else n for n in LAYOUTS
]


@pytest.mark.parametrize("name", CASES)
def test_fake_equals_real_per_rank_and_phase(real, name):
    cell = layout_cell(name)
    fake_records = estimate_ranks(cell, [0, 1])
    fake = _peaks(fake_records)
    for rank, rows in enumerate(fake_records):
        moved, really = {r["system"]: r["offloaded_bytes"] for r in rows}, real[name][rank]["offloaded"]
        assert moved["baseline"] is really["baseline"] is None, (name, rank)
        if not cell.offload:
            assert moved["prefixflow"] is really["prefixflow"] is None, (name, rank)
            continue
        # the fake tier moves what the file tier does, within the peaks' tolerance: under TP it moves one
        # 24,576 B storage more (open, docs/estimate.md "Layouts")
        assert really["prefixflow"] > 0, (name, rank, really)
        assert abs(moved["prefixflow"] - really["prefixflow"]) <= _tolerance(really["prefixflow"]), (name, moved)
    gaps = []
    for rank in (0, 1):
        for system in SYSTEMS:
            measured, estimated = real[name][rank]["peaks"][system], fake[rank][system]
            late = real[name][rank]["late"][system]
            assert set(measured) == set(estimated), (name, rank, system)
            for phase, value in measured.items():
                gap = estimated[phase] - value
                line = f"{name} rank {rank} {system} {phase}: {gap:+.0f} B of {value:.0f} ({late:.0f} B freed late)"
                gaps.append((line, gap, value, late))
    print("\n".join(g[0] for g in gaps))
    in_flight = _largest_unit_grad_bytes(cell) if cell.parallel.dp_shard > 1 else 0
    for line, gap, value, late in gaps:
        # The fake group's collectives finish at once; a real rank's may hold buffers longer:
        # - FSDP2's reduce-scatters run asynchronously on gloo, so a real rank may still hold one unit's
        #   unsharded gradient when its phase peaks (seen: +145,160 and +291,080 B on rank 1's Phase C);
        # - a gloo thread may drop a finished collective's buffers after this thread did (the storage then
        #   dies on that thread: ``foreign_freed_bytes``). Seen under CPU load: TP2's Phase B +147,456 B with
        #   49,152 + 98,304 B freed late.
        # The fake peak is the real one's floor, less the tolerance.
        assert -in_flight - late - _tolerance(value) <= gap <= _tolerance(value), line


def test_layout_records_are_rank_max_with_the_ranks_named():
    cell = layout_cell("pp2")
    records = {r["system"]: r for r in estimate_layout(cell)}
    per_rank = _peaks(estimate_ranks(cell, [0, 1]))
    for system in SYSTEMS:
        rec = records[system]
        assert rec["status"] == "ok" and rec["mem_meter"] == "fake-live-bytes", rec.get("error")
        assert json.loads(rec["estimate_ranks"]) == [0, 1]  # two pipeline stages: both run
        assert rec["peak_mem_phase_b_bytes"] == max(p[system]["B" if system != "baseline" else "full"]
                                                    for p in per_rank) or system == "baseline"  # fmt: skip
        assert rec["peak_mem_bytes"] == max(max(p[system].values()) for p in per_rank)


def test_chosen_ranks_stand_for_every_rank_on_tp2_cp2_pp2():
    cell = Cell(spec="estimate-layouts", model=TINY, prefix_len=96, suffix_len=24, n=3, dtype="fp64",
                microbatch=1, parallel={"tp": 2, "cp": 2, "pp": 2}, ac="selective",
                systems=SYSTEMS, warmup=0, repeats=1, device="cpu")  # fmt: skip
    stand_for = representatives(cell)
    assert chosen_ranks(cell) == [0, 2, 4, 6]  # TP ranks collapse; every (stage, CP shard) runs
    every = _peaks(estimate_ranks(cell, list(range(8))))
    for rank, rep in enumerate(stand_for):
        assert every[rank] == every[rep], (rank, rep)
    chosen = {r["system"]: r for r in estimate_layout(cell)}
    for system in SYSTEMS:
        assert chosen[system]["status"] == "ok", chosen[system].get("error")
        assert chosen[system]["peak_mem_bytes"] == max(max(p[system].values()) for p in every)
        for phase in every[0][system]:
            column = f"peak_mem_phase_{phase.lower()}_bytes"
            assert chosen[system][column] == max(p[system][phase] for p in every), (system, phase)


@pytest.mark.parametrize("name", ["tp2-selective", "cp2-selective"])
def test_offload_under_sac_keeps_gradients_bitwise_on_real_ranks(real, name):
    # TP's reduce-scatter outputs, which SAC keeps, stay resident (prefixflow.memory.sac_cache): copied out
    # before their wait, they made the gradients differ from run to run
    for rank in (0, 1):
        assert real[f"{name}-offload"][rank]["grads"]["prefixflow"] == real[name][rank]["grads"]["prefixflow"]


def test_live_bytes_count_a_dtensors_local_shard_not_its_global_size():
    # A DTensor's own untyped_storage() reports the global size: counted, TP and FSDP2 records doubled their
    # sharded tensors (Llama3-8B TP2xCP4: 31 GiB of a 40 GiB baseline peak was fixed, params were 7.5 GiB).
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from harness.estimate.world import fake_world
    from prefixflow.memory.live_bytes import LiveBytesMeter

    with fake_world(2, 0):
        mesh = init_device_mesh("cpu", (2,))
        local = torch.zeros(256, 1024)  # 1 MiB
        meter = LiveBytesMeter()
        with meter:
            d = DTensor.from_local(local, mesh, [Shard(0)], run_check=False) * 2.0
        assert d.untyped_storage().nbytes() == 2 * local.untyped_storage().nbytes()
        assert meter.current == 2 << 20 == meter.peak  # the shard it wraps and the product: 1 MiB each
        assert meter.register(torch.nn.Parameter(d)) == 0  # already counted: its local shard
        assert dist.get_world_size() == 2
