"""FLOP counting changes no memory (issue 34, item 3): the same step metered with and without the FLOP counters
peaks within 1% per phase, for AC none, selective and full, on the baseline and PrefixFlow, and full AC peaks
below no AC. Under ``torch.utils.flop_counter.FlopCounterMode`` full AC's backward peaked at 2.8x its real
peak (its module tracker's grad hooks keep the recompute's tensors alive; see harness.costmodel.counting)."""

from __future__ import annotations

import pytest
import torch

from harness.costmodel.flops import count_flops
from harness.run.loop import collector_paused
from harness.run.measure import PhaseMeter
from harness.run.setup import build_for, make_group
from harness.spec.cell import Cell, ModelSpec

MODEL = ModelSpec(
    name="llama3:debugmodel",
    overrides={"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512},
)


def _peaks(system: str, ac: str, counted: bool) -> dict[str, float]:
    cell = Cell(
        spec="t", model=MODEL, prefix_len=384, suffix_len=96, n=2, microbatch=1, ac=ac, dtype="fp32",
        systems=(system,),
    )  # fmt: skip
    device = torch.device("cpu")
    contender, model = build_for(system, cell, device)
    group = make_group(cell, 512)
    meter = PhaseMeter(device, model=model, track_memory=True)
    with collector_paused(True), meter:
        train = lambda: contender.step(model, [group], cell, meter)  # noqa: E731
        if counted:
            flops, _ = count_flops(train)
            assert flops.gemm > 0 and flops.attention > 0
        else:
            train()
    results = meter.results(extended=True)
    return {"step": results["peak_mem_bytes"], **results["phase_peak_bytes"]}


@pytest.mark.parametrize("system", ["baseline", "prefixflow"])
def test_flop_counting_leaves_memory_unchanged(system):
    plain = {}
    for ac in ("none", "selective", "full"):
        plain[ac] = _peaks(system, ac, counted=False)
        counted = _peaks(system, ac, counted=True)
        assert plain[ac].keys() == counted.keys()
        for phase, want in plain[ac].items():
            assert counted[phase] == pytest.approx(want, rel=0.01), (ac, phase, counted[phase], want)
    assert plain["full"]["step"] < plain["none"]["step"]
    assert plain["full"]["step"] < plain["selective"]["step"] < plain["none"]["step"]
