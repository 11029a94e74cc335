"""pf-bench records of CP and PP cells: the schedule hooks' counters reach the record (Figures 6a and 6b).

Two two-rank cells through the local executor (one torchrun launch each): CP2 with prefetched and on-demand
prefix K/V gathers, and PP2 with stage-local and barrier phase switching.
"""

from __future__ import annotations

import json

import pytest

from harness.execute.executors import LocalExecutor
from harness.records import read_records
from harness.spec.load import expand, parse_spec

LAYERS, N = 2, 3
AXES = {
    "models": [
        {
            "name": "llama3:debugmodel",
            "overrides": {"dim": 64, "n_layers": LAYERS, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 128},
        }
    ],
    "lengths": [{"prefix": 24, "suffix": 6}],
    "n": [N],
    "microbatch": [1],
}
SPEC = {
    "name": "pcppp",
    "warmup": 0,
    "repeats": 2,
    "axes": {**AXES, "parallel": [{"cp": 2}], "systems": ["baseline", "prefixflow", "prefixflow_cp_demand"]},
    "extra_axes": [{**AXES, "parallel": [{"pp": 2}], "systems": ["prefixflow", "prefixflow_pp_barrier"]}],
    "executor": {"max_jobs": 1, "timeout_min": 15},
}


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pcppp")
    cells = expand(parse_spec(SPEC))
    assert len(cells) == 2
    done = {}
    LocalExecutor(max_jobs=1).run(cells, folder, lambda c, s: done.__setitem__(c.cell_id, s))
    out = {}
    for cell in cells:
        df = read_records(folder / f"{cell.cell_id}.parquet")
        assert done[cell.cell_id] == "ok", df["error"].tolist()
        out["cp" if cell.parallel.cp > 1 else "pp"] = df.set_index("system")
    return out


def test_cp_records_count_demand_and_prefetched_gathers_per_layer_and_microbatch(records):
    cp = records["cp"]
    pf, demand = cp.loc["prefixflow"], cp.loc["prefixflow_cp_demand"]
    # prefetch: only each suffix microbatch's first layer waits on demand; on demand: every layer does
    assert (pf["cp_demand_gathers"], pf["cp_prefetched_gathers"]) == (N, N * (LAYERS - 1))
    assert (demand["cp_demand_gathers"], demand["cp_prefetched_gathers"]) == (N * LAYERS, 0)
    assert pf["cp_gather_bytes"] == demand["cp_gather_bytes"] > 0  # same traffic, different timing
    assert pf["cp_scatter_bytes"] == demand["cp_scatter_bytes"] > 0
    assert demand["cp_overlapped_s"] == 0 and pf["cp_overlapped_s"] >= 0
    for row in (pf, demand):
        assert row["cp_exposed_s"] >= 0 and row["phase_b_s"] > 0
        assert row["cp_phase_b_rank_max_s"] >= row["cp_phase_b_rank_min_s"] > 0
        assert row["cp_phase_b_spread_s"] == pytest.approx(
            row["cp_phase_b_rank_max_s"] - row["cp_phase_b_rank_min_s"]
        )
    assert cp.loc["baseline", "cp_demand_gathers"] == 0  # the baseline has no prefix view
    assert cp.loc["baseline", "cp_sequence_exchanges"] > 0


def test_pp_records_hold_every_stage_timeline_and_the_bubbles(records):
    pp = records["pp"]
    for system, switching in (("prefixflow", "stage_local"), ("prefixflow_pp_barrier", "barrier")):
        row = pp.loc[system]
        stages = json.loads(row["pp_timelines"])
        assert len(stages) == 2
        for events in stages:
            ops = [e["op"] for e in events]
            assert ops[0] == "A" and ops[-1] == "C" and ops.count("F") == ops.count("B") == N
            assert ("barrier" in ops) == (switching == "barrier")
        # the timelines are the median timed step's, the one whose span and bubbles the record holds
        assert max(e["end"] for events in stages for e in events) == row["pp_span_s"]
        assert row["pp_bubble_max_s"] >= row["pp_bubble_mean_s"] >= 0
        assert row["pp_span_s"] > 0 and row["step_time_s"] > 0
