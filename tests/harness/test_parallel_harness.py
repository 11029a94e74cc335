"""pf-bench on many ranks: one two-rank cell through the local executor (one torchrun launch).

The cell trains three groups on two FSDP2 ranks, so one group is split: the record must carry the rank-max
time with per-rank values and spread, one reduce-scatter per FSDP unit, and split bytes equal to the prefix
K/V and gK/gV sizes.
"""

from __future__ import annotations

import json

import pytest

from harness.execute.executors import LocalExecutor
from harness.records import read_records
from harness.spec.load import expand, parse_spec

SPEC = {
    "name": "pharness",
    "warmup": 0,
    "repeats": 2,
    "axes": {
        "models": [
            {
                "name": "llama3:debugmodel",
                "overrides": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 128},
            }
        ],
        "lengths": [{"prefix": 24, "suffix": 6}],
        "n": [4],
        "microbatch": [1],
        "parallel": [{"dp_shard": 2}],
        "groups": [3],
    },
    "executor": {"max_jobs": 2, "timeout_min": 15},
}


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pharness")
    (cell,) = expand(parse_spec(SPEC))
    done = {}
    LocalExecutor(max_jobs=2).run([cell], folder, lambda c, s: done.__setitem__(c.cell_id, s))
    df = read_records(folder / f"{cell.cell_id}.parquet")
    assert done == {cell.cell_id: "ok"}, df["error"].tolist()
    return df.set_index("system")


def test_the_record_holds_the_rank_max_with_per_rank_values_and_their_spread(record):
    for system in ("baseline", "prefixflow"):
        row = record.loc[system]
        per_rank = json.loads(row["step_time_s_per_rank"])
        assert len(per_rank) == 2 and all(t > 0 for t in per_rank)
        # each step takes its slowest rank, so the median dominates every rank's own median
        assert row["step_time_s"] >= max(per_rank) * (1 - 1e-12)
        assert 0 <= row["step_time_s_spread"] < 1
        assert row["world_size"] == 2 and row["dp_shard"] == 2 and row["parallel_layout"] == "dp_shard2"
        assert row["groups_per_step"] == 3


def test_fsdp_reduces_each_unit_once_per_step_and_the_split_group_exchanges_exactly_kv(record):
    for system in ("baseline", "prefixflow"):
        row = record.loc[system]
        assert row["grad_sync"] == "fsdp-gathered"  # unequal work per rank: parameters held for the step
        assert row["fsdp_reduce_scatters_per_unit"] == 1
        assert row["fsdp_reduce_scatters"] == row["fsdp_units"]
        assert row["split_groups"] == 1
    pf = record.loc["prefixflow"]
    assert pf["split_kv_bytes"] == pf["split_expected_kv_bytes"] > 0
    assert pf["split_grad_kv_bytes"] == pf["split_expected_grad_kv_bytes"] > 0
    assert bool(pf["split_exchange_exact"])
    assert record.loc["baseline", "split_kv_bytes"] == 0  # split baseline sequences need no exchange
