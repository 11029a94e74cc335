"""fp64 exactness on two ranks (one torchrun launch): TP2, FSDP2, DP2 with placement, DP2 with a split group.

Loss and every gradient, gathered to a full tensor, within 1e-9 relative of one process training the same
step's groups with the baseline; Llama3 and Qwen3 (GQA), padded and packed, microbatch None and 1, AC
none/selective/full. FSDP2: one reduce-scatter per unit per step and no state left after a step or an error.
Split groups: the bytes exchanged are exactly the prefix K/V and gK/gV. Negative controls must fail.
"""

from __future__ import annotations

import pytest
from support.parallel_launch import TOL, check_exact, run_suite
from support.parallel_worker import SUITES

NAMES = [name for name, _ in SUITES["two_ranks"]]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_suite("two_ranks", 2, tmp_path_factory.mktemp("parallel"))


@pytest.mark.parametrize("name", [n for n in NAMES if not n.startswith(("control-", "fsdp2-error"))])
def test_matches_one_process(results, name):
    check_exact(results[name])


@pytest.mark.parametrize(
    "name", [n for n in NAMES if n.startswith("fsdp2") and "error" not in n and "residue" not in n]
)
def test_fsdp_reduces_each_unit_once_per_step(results, name):
    sync = results[name]["grad_sync"]
    assert sync["max_reduce_scatters_per_unit"] == 1, sync
    assert sync["reduce_scatters"] == sync["units"], sync


def test_lockstep_steps_run_zero3_and_uneven_ones_gather_for_the_step(results):
    assert results["fsdp2-accumulate-4-groups-llama3-prefixflow"]["grad_sync"]["mode"] == "fsdp-zero3"
    assert results["fsdp2-unbalanced-3-groups-qwen3-prefixflow"]["grad_sync"]["mode"] == "fsdp-gathered"
    assert results["fsdp2-split-llama3-prefixflow"]["grad_sync"]["mode"] == "fsdp-gathered"


@pytest.mark.parametrize("name", [n for n in NAMES if "split" in n and n.endswith("prefixflow")])
def test_split_group_exchanges_exactly_prefix_kv_and_grad_kv(results, name):
    r = results[name]
    assert r["split_groups"] == [0]
    ex = r["exchange"]
    assert ex["kv_bytes"] > 0 and ex["grad_kv_bytes"] > 0
    assert ex["kv_bytes"] == ex["expected_kv_bytes"], ex
    assert ex["grad_kv_bytes"] == ex["expected_grad_kv_bytes"], ex
    # nothing else crosses ranks: every point-to-point byte on the wire is K/V or gK/gV
    wire = r["point_to_point"]
    assert wire["sent"] == wire["received"] == ex["kv_bytes"] + ex["grad_kv_bytes"], (wire, ex)


@pytest.mark.parametrize("name", [n for n in NAMES if "split" in n and n.endswith("baseline")])
def test_split_baseline_group_exchanges_nothing(results, name):
    assert results[name]["split_groups"] == [0]
    assert results[name]["exchange"]["kv_bytes"] == results[name]["exchange"]["grad_kv_bytes"] == 0
    assert results[name]["point_to_point"] == {"sent": 0, "received": 0}


@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith("fsdp2-error")])
def test_an_error_in_any_phase_leaves_no_fsdp_state_and_the_next_step_is_exact(results, name):
    r = results[name]
    assert r["raised"]
    assert r["residue_after_error"] == [], r["residue_after_error"]
    check_exact(r)


@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith("control-")])
def test_negative_controls_fail(results, name):
    r = results[name]
    assert "error" not in r, r["error"]
    assert r["max_rel"] > 1e3 * TOL, r


def test_each_group_leaves_fsdp_idle_and_resharded_and_the_deferred_reduction_leaves_nothing(results):
    r = results["fsdp2-residue-after-each-group"]
    assert "error" not in r, r["error"]
    assert r["per_group"] == [[], [], []], r["per_group"]
    assert r["deferred"] == [[], [], []], r["deferred"]
    check_exact(r)  # gradients: 2 passes x 2 ranks (SUM) = 4x one process; residue after the block: none


def test_a_split_owner_that_trains_no_response_still_pays_the_prefix(results):
    """The placement gives both responses to the helper: the owner forwards and backwards the prefix only."""
    res = results["dp2-split-owner-trains-none-llama3-prefixflow"]
    assert res["split_owner_responses"] == [0], res
    assert res["exchange"]["kv_bytes"] > 0 and res["exchange"]["grad_kv_bytes"] > 0, res
