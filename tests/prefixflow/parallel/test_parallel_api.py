"""Single-process parts of prefixflow.parallel: degrees, validation, group placement, rank-max merging."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from conftest import tiny_model

import prefixflow as pf
from harness.execute.local import local_ranks_argv
from harness.run.parallel_step import merge_rank_samples
from prefixflow.parallel import ParallelDims, parallel_state, parallelize
from prefixflow.parallel.dp import group_costs, place_groups, train_step


def test_dims_use_torchtitan_names_and_reject_others():
    dims = ParallelDims.of({"tp": 2, "dp_shard": 2})
    assert dims.world_size == 4 and dims.batch == 2 and dims.fsdp_enabled
    assert dims.label == "dp_shard2-tp2"
    with pytest.raises(ValueError, match="unknown parallel dimension.*'dp'.*TorchTitan"):
        ParallelDims.of({"dp": 2})
    with pytest.raises(ValueError, match="tp must be an int >= 1"):
        ParallelDims(tp=0)
    with pytest.raises(ValueError, match="ep=4 must divide"):
        ParallelDims(ep=4, tp=2)


@pytest.mark.parametrize("dims", [{"ep": 2, "dp_shard": 2}])
def test_ep_on_a_dense_model_is_rejected_with_a_clear_error_before_anything_changes(dims):
    model = tiny_model("llama3")
    with pytest.raises(ValueError, match="needs an MoE model"):
        parallelize(model, dims)
    assert parallel_state(model) is None


def test_parallelize_needs_prefixflow_wrappers_first():
    model = pf.build_model("llama3:debugmodel", overrides={"dim": 64, "n_layers": 1, "n_heads": 4})
    with pytest.raises(ValueError, match="apply_prefixflow"):
        parallelize(model, {"tp": 1})


def test_lpt_placement_balances_whole_groups_and_is_deterministic():
    costs = [(0.0, [5.0]), (0.0, [4.0]), (0.0, [3.0]), (0.0, [3.0]), (0.0, [3.0])]
    p = place_groups(costs, 2, split_threshold=None)
    assert p.loads == [8.0, 10.0]  # LPT: 5 -> r0, 4 -> r1, 3 -> r1, 3 -> r0, 3 -> r1
    assert [[w.group for w in ws] for ws in p.work] == [[0, 3], [1, 2, 4]]
    assert p.split_groups == ()
    assert place_groups(costs, 2, split_threshold=None).as_dict() == p.as_dict()


def test_split_fallback_splits_the_largest_group_when_ranks_are_unbalanced():
    costs = [(10.0, [5.0, 5.0, 5.0, 5.0]), (0.0, [2.0])]  # one big group, one small: 30 vs 2
    whole = place_groups(costs, 2, split_threshold=None)
    assert whole.imbalance > 0.8
    p = place_groups(costs, 2, split_threshold=0.25)
    assert p.split_groups == (0,)
    parts = [w for ws in p.work for w in ws if w.group == 0]
    assert {w.owner for w in parts} == {parts[0].owner} and len(parts) == 2
    assert sorted(i for w in parts for i in w.responses) == [0, 1, 2, 3]
    assert p.imbalance < whole.imbalance
    for ws in p.work:  # split groups run first, in group order, on every rank that holds a part
        assert ws[0].group == 0


def test_a_split_that_does_not_help_is_not_made():
    costs = [(0.0, [1.0]), (0.0, [1.0])]
    assert place_groups(costs, 2, split_threshold=0.0).split_groups == ()


def test_costs_charge_the_prefix_once_for_prefixflow_and_per_sequence_for_the_baseline():
    model = tiny_model("llama3")
    group = pf.synthetic_group(97, 40, [4, 4, 4], seed=0)
    pre, resp = group_costs(model, group, "prefixflow")
    base_pre, base_resp = group_costs(model, group, "baseline")
    assert base_pre == 0 and pre > 0
    assert sum(base_resp) > pre + sum(resp)


def test_train_step_on_one_process_equals_train_group_per_group():
    model, ref = tiny_model("llama3"), tiny_model("llama3")
    groups = [pf.synthetic_group(97, 10, [3, 5], seed=s) for s in range(3)]
    stats = train_step(model, groups, microbatch=1)
    total = sum(pf.train_group(ref, g, microbatch=1).loss for g in groups)
    assert stats.grad_sync["mode"] == "none" and len(stats.groups) == 3
    assert math.isclose(stats.loss, total, rel_tol=1e-12)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert (p.grad - q.grad).abs().max() <= 1e-12 * q.grad.abs().max()


def _rank(times: list[float], peak: float, status: str = "ok") -> list[dict]:
    samples = [{"step_time_s": t, "phase_a_s": t / 4, "phase_b_s": t / 2, "phase_c_s": t / 4} for t in times]
    return [
        {
            "system": "prefixflow",
            "status": status,
            "error": None if status == "ok" else "boom",
            "samples": samples,
            "memory": {"peak_mem_bytes": peak, "peak_mem_phase_b_bytes": peak, "mem_meter": "cpu-live-bytes"},
            "rank": 0,
        }
    ]


def test_rank_samples_merge_to_the_median_of_per_step_rank_max_with_per_rank_values_and_spread():
    (rec,) = merge_rank_samples([_rank([1.0, 3.0, 2.0], 10.0), _rank([2.0, 1.0, 2.5], 30.0)])
    assert rec["step_time_s"] == 2.5  # per step max: 2, 3, 2.5 -> median 2.5
    assert (rec["step_time_min_s"], rec["step_time_max_s"]) == (2.0, 3.0)
    assert json.loads(rec["step_time_s_per_rank"]) == [2.0, 2.0]
    assert rec["step_time_s_spread"] == 0.0
    assert rec["peak_mem_bytes"] == 30.0 and rec["peak_mem_bytes_spread"] == pytest.approx(2 / 3)
    assert rec["mem_meter"] == "cpu-live-bytes"
    assert "samples" not in rec and "rank" not in rec and "memory" not in rec
    (rec,) = merge_rank_samples([_rank([1.0], 1.0), _rank([1.0], 1.0, status="error")])
    assert rec["status"] == "error" and rec["error"] == "boom" and "step_time_s" not in rec


def test_local_ranks_argv_uses_the_loopback_launcher_and_runs_a_module():
    argv = local_ranks_argv(2, "harness.rank_worker", ["job.json"])
    assert argv[1:3] == ["-m", "harness.execute.local_ranks"]
    assert "--nproc-per-node=2" in argv and argv[-3:] == ["-m", "harness.rank_worker", "job.json"]


def _spec(axes_extra: dict) -> dict:
    return {
        "name": "p",
        "axes": {
            "models": [{"name": "llama3:debugmodel"}],
            "lengths": [{"prefix": 8, "suffix": 4}],
            "n": [2],
            **axes_extra,
        },
    }


def test_spec_axes_take_torchtitan_names_and_old_dp_is_rejected_naming_the_new_ones():
    from harness.spec.load import SpecError, expand, parse_spec

    cells = expand(parse_spec(_spec({"tp": [1, 2], "dp_shard": [1, 2]})))
    assert sorted(c.parallel.label for c in cells) == ["dp_shard2", "dp_shard2-tp2", "single", "tp2"]
    assert {c.world_size for c in cells} == {1, 2, 4}
    cells = expand(parse_spec(_spec({"parallel": [{"dp_replicate": 2}], "groups": [3]})))
    assert cells[0].groups_per_step == 3 and cells[0].parallel.batch == 2
    with pytest.raises(SpecError, match="dp_replicate.*dp_shard"):
        parse_spec(_spec({"parallel": [{"dp": 2}]}))
    with pytest.raises(SpecError, match="either 'parallel'"):
        parse_spec(_spec({"parallel": [{"tp": 2}], "tp": [2]}))


def test_cells_recorded_before_the_data_parallel_split_keep_their_ids():
    from harness.spec.cell import Cell, ModelSpec

    plain = Cell(
        spec="s",
        model=ModelSpec(name="llama3:debugmodel", overrides={"dim": 64}),
        prefix_len=96,
        suffix_len=32,
        n=4,
    )
    assert plain.cell_id == "23d39525bfde"  # the id this cell had before (recorded results stay valid)
    tp_cp = Cell(
        spec="s",
        model=ModelSpec(name="llama3:debugmodel"),
        prefix_len=96,
        suffix_len=32,
        n=4,
        parallel={"tp": 2, "cp": 4},
    )
    assert tp_cp.cell_id == "f195e628a3b6"
    dp = Cell.model_validate({**plain.model_dump(), "parallel": {"dp_shard": 2}})
    assert dp.cell_id != plain.cell_id


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_split_helpers_derive_the_owners_prefix_kv_geometry_and_a_wrong_one_is_refused(family, dtype):
    """A split group's helpers size their receive from the model and the group alone (no header crosses
    ranks): the geometry must be exactly what Phase A captures, and the owner refuses to send otherwise."""
    from prefixflow.parallel.dp import check_captured, prefix_kv_geometry
    from prefixflow.schedule.caches import NodeCaches
    from prefixflow.schedule.driver import resolve
    from prefixflow.schedule.phases import node_forwards, waves

    model = tiny_model(family, dtype=dtype)
    group = pf.synthetic_group(97, 11, [3, 5], seed=0)
    run = resolve(model, group)
    caches = NodeCaches(run, offload=False)
    with torch.no_grad():
        node_forwards(run, caches, next(waves(run)))
    cache = caches.only()
    geometry = prefix_kv_geometry(model, group)
    check_captured(cache, geometry)
    assert geometry.layers == (0, 1) and geometry.tokens == 10 and geometry.dtype == dtype
    assert geometry.numel == sum(t.numel() for e in cache.layers.values() for t in (e.live_k, e.live_v))
    for wrong in (
        dataclasses.replace(geometry, tokens=11),
        dataclasses.replace(geometry, kv_heads=geometry.kv_heads * 2),
        dataclasses.replace(geometry, dtype=torch.bfloat16),
        dataclasses.replace(geometry, layers=(0,)),
    ):
        with pytest.raises(RuntimeError, match="split group: the owner captured"):
            check_captured(cache, wrong)


def test_hook_columns_come_from_the_median_timed_step_not_the_last_one():
    from harness.run.parallel_step import median_step

    assert median_step([{"step_time_s": t} for t in (0.2, 0.3, 0.1)]) == 0
    assert median_step([{"step_time_s": t} for t in (0.5, 0.1, 0.2, 0.4)]) == 2
    assert median_step([{"step_time_s": 0.7}]) == 0


def test_costs_of_a_transformers_model_equal_the_torchtitan_model_of_the_same_shape():
    from prefixflow.integrations import hf
    from prefixflow.model.models import hidden_dim_of, model_args

    titan = tiny_model("llama3")
    args = model_args(titan)
    shape = {"hidden_size": args.dim, "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
             "num_key_value_heads": args.n_kv_heads, "intermediate_size": hidden_dim_of(args),
             "vocab_size": args.vocab_size}  # fmt: skip
    model = pf.apply_prefixflow(hf.build_hf_model("llama-tiny", dtype=torch.float64, overrides=shape))
    paths = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9]]
    tree = pf.build_tree([torch.tensor(p) for p in paths], [1.0, -1.0, 0.5])
    for group in (pf.synthetic_group(97, 40, [4, 6, 2], seed=0), tree):
        for system in ("prefixflow", "baseline"):
            assert group_costs(model, group, system) == group_costs(titan, group, system)


def test_train_step_on_a_transformers_model_equals_train_group_per_group():
    from prefixflow.integrations import hf

    def build():
        return pf.apply_prefixflow(
            hf.build_hf_model("llama-tiny", dtype=torch.float64, overrides={"vocab_size": 97})
        )

    model, ref = build(), build()
    groups = [pf.synthetic_group(97, 10, [3, 5], seed=s) for s in range(2)]
    stats = train_step(model, groups, microbatch=1)
    total = sum(pf.train_group(ref, g, microbatch=1).loss for g in groups)
    assert math.isclose(stats.loss, total, rel_tol=1e-12)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert (p.grad - q.grad).abs().max() <= 1e-12 * q.grad.abs().max()
