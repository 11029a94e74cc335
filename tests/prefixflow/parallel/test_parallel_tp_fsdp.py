"""fp64 exactness on four ranks (one torchrun launch): TP2 x FSDP2 and TP2 x DP2 with a split group."""

from __future__ import annotations

import pytest
from support.parallel_launch import check_exact, run_suite
from support.parallel_worker import SUITES

NAMES = [name for name, _ in SUITES["four_ranks"]]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_suite("four_ranks", 4, tmp_path_factory.mktemp("parallel4"))


@pytest.mark.parametrize("name", NAMES)
def test_matches_one_process(results, name):
    check_exact(results[name])
    sync = results[name]["grad_sync"]
    if sync["mode"].startswith("fsdp"):
        assert sync["max_reduce_scatters_per_unit"] == 1, sync


def test_split_group_under_tp_exchanges_each_ranks_head_shard(results):
    r = results["tp2xdp2-split-qwen3-prefixflow"]
    ex = r["exchange"]
    assert ex["kv_bytes"] == ex["expected_kv_bytes"] > 0
    assert ex["grad_kv_bytes"] == ex["expected_grad_kv_bytes"] > 0
    assert (
        r["point_to_point"]["sent"] == r["point_to_point"]["received"] == ex["kv_bytes"] + ex["grad_kv_bytes"]
    )
