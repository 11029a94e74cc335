"""The cell runner: interleaving, separate model copies, per-system failure isolation, OOM classification."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest
import torch

from harness import contenders
from harness.contenders import TrainGroupContender, available_contenders, get_contender, register_contender
from harness.execute.executors import CellJob
from harness.run.columns import classify
from harness.run.measurement import measure_cell
from harness.run.setup import make_group
from harness.spec.cell import Cell, ModelSpec

TINY = ModelSpec(
    name="llama3:debugmodel", overrides={"dim": 32, "n_layers": 2, "n_heads": 2, "vocab_size": 128}
)


def _cell(systems_, **over) -> Cell:
    base = dict(
        spec="t", model=TINY, prefix_len=12, suffix_len=4, n=2, warmup=1, repeats=2, systems=tuple(systems_)
    )
    return Cell(**{**base, **over})


class Recorder(TrainGroupContender):
    log: list[tuple[str, int, float]] = []

    def step(self, model, groups, cell, observer):
        first = next(model.parameters())
        Recorder.log.append((self.name, id(model), float(first.detach().sum())))
        return super().step(model, groups, cell, observer)


class Exploding(TrainGroupContender):
    exc: type[BaseException] = RuntimeError

    def step(self, model, groups, cell, observer):
        raise self.exc("boom from the test system")


@pytest.fixture
def test_systems():
    added = {
        "rec_a": lambda: Recorder("rec_a", "baseline", False),
        "rec_b": lambda: Recorder("rec_b", "prefixflow", True),
        "explode": lambda: Exploding("explode", "baseline", False),
    }
    for name, factory in added.items():
        register_contender(name, factory)
    Recorder.log = []
    yield
    for name in added:
        contenders._REGISTRY.pop(name)


def test_registry():
    assert {"baseline", "prefixflow"} <= set(available_contenders())
    with pytest.raises(ValueError, match="already registered"):
        register_contender("baseline", lambda: None)
    with pytest.raises(ValueError, match="unknown system 'prefix_grouperx'.*baseline"):
        get_contender("prefix_grouperx")


def test_systems_interleave_on_separate_identical_models(test_systems):
    records = measure_cell(_cell(["rec_a", "rec_b"]))
    assert [r["status"] for r in records] == ["ok", "ok"]
    names = [name for name, _, _ in Recorder.log]
    # warm-up, 2 timed repeats (the order reversed on odd steps), 1 CPU memory step, 1 FLOP-counting step
    assert names == ["rec_a", "rec_b", "rec_b", "rec_a", "rec_a", "rec_b", "rec_a", "rec_b", "rec_a", "rec_b"]
    ids = {name: {i for n, i, _ in Recorder.log if n == name} for name in ("rec_a", "rec_b")}
    assert len(ids["rec_a"]) == 1 and ids["rec_a"].isdisjoint(ids["rec_b"])
    sums = {name: s for name, _, s in Recorder.log[:2]}
    assert sums["rec_a"] == sums["rec_b"]  # same seed -> same initial weights
    assert records[0]["repeats"] == 2 and records[0]["step_time_min_s"] <= records[0]["step_time_s"]


def test_a_failing_system_does_not_stop_the_other(test_systems):
    records = {r["system"]: r for r in measure_cell(_cell(["explode", "rec_a"]))}
    assert records["explode"]["status"] == "error"
    assert (
        "Traceback" in records["explode"]["error"]
        and "boom from the test system" in records["explode"]["error"]
    )
    assert records["rec_a"]["status"] == "ok" and records["rec_a"]["step_time_s"] > 0


def test_memory_errors_are_oom(test_systems, monkeypatch):
    monkeypatch.setattr(Exploding, "exc", MemoryError)
    assert measure_cell(_cell(["explode"]))[0]["status"] == "oom"
    assert classify(torch.OutOfMemoryError("CUDA out of memory")) == "oom"
    assert classify(RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory")) == "oom"
    assert classify(ValueError("bad shape")) == "error"


def test_group_is_deterministic_and_spread_varies_lengths():
    cell = _cell(["baseline"], suffix_spread=0.5, n=8)
    a, b = make_group(cell, 128), make_group(cell, 128)
    assert torch.equal(a.prompt, b.prompt) and all(
        torch.equal(x, y) for x, y in zip(a.responses, b.responses, strict=True)
    )
    lens = [len(r) for r in a.responses]
    assert len(a.prompt) == 12 and all(2 <= s <= 4 for s in lens) and len(set(lens)) > 1
    assert {len(r) for r in make_group(_cell(["baseline"]), 128).responses} == {4}


def test_offload_is_passed_to_prefixflow():
    from prefixflow import PrefixFlowConfig

    # the harness's "prefixflow" system is the library default (attention="auto"); the variants pin theirs
    default = PrefixFlowConfig()
    assert contenders.prefixflow_config(_cell(["prefixflow"], offload=True)) == replace(default, offload=True)
    assert contenders.prefixflow_config(_cell(["prefixflow"])) == default
    concat = PrefixFlowConfig(attention="concat")
    assert contenders.prefixflow_config(_cell(["prefixflow_concat"]), "concat") == concat


def test_slurm_job_is_checkpointable_and_requeues_the_same_cell(tmp_path):
    job = CellJob()
    delayed = job.checkpoint(str(tmp_path / "job.json"))
    assert delayed.function is job and delayed.args == (str(tmp_path / "job.json"),)
    assert pickle.loads(pickle.dumps(job)).__class__ is CellJob


def test_memory_only_is_one_metered_step_per_system(test_systems):
    records = measure_cell(_cell(["rec_a", "rec_b"]), memory_only=True)
    assert [name for name, _, _ in Recorder.log] == ["rec_a", "rec_b"]  # no warm-up, no timed repeats
    assert all(r["status"] == "ok" and r["mem_meter"] == "cpu-live-bytes" for r in records)
    assert all(r["peak_mem_bytes"] > 0 and r["step_time_s"] > 0 for r in records)


def test_baseline_rows_of_an_offload_cell_do_not_claim_offload():
    records = {
        r["system"]: r for r in measure_cell(_cell(["baseline", "prefixflow"], offload=True, prefix_len=200))
    }
    assert records["baseline"]["offload"] is False and records["baseline"]["offloaded_bytes"] is None
    pf = records["prefixflow"]
    assert pf["offload"] is True and pf["offload_tier"] == "cpu-file" and pf["offloaded_bytes"] > 0
    assert pf["offloaded_bytes"] == pf["prefetched_bytes"] + pf["demand_loaded_bytes"] + pf["dropped_bytes"]


def test_records_carry_modelled_and_counted_flops_and_the_revision():
    records = {r["system"]: r for r in measure_cell(_cell(["baseline", "prefixflow", "prefixflow_concat"]))}
    for name, rec in records.items():
        assert rec["status"] == "ok", rec["error"]
        assert rec["model_flops"] == rec["counted_flops"] > 0, name  # this tiny case: exact
        assert rec["counted_gemm_flops"] + rec["counted_attention_flops"] == rec["counted_flops"]
        assert rec["ideal_speedup"] > rec["paper_ideal_speedup"] > 1
        assert rec["git_rev"] and rec["git_rev"] != "unknown"
    assert (
        records["prefixflow"]["attention"] == "split"
        and records["prefixflow_concat"]["attention"] == "concat"
    )
    assert records["baseline"]["attention"] is None
    # concat computes the suffix's causal upper triangle: more attention FLOPs than split, same GEMMs
    pf, concat = records["prefixflow"], records["prefixflow_concat"]
    assert concat["counted_attention_flops"] > pf["counted_attention_flops"]
    assert concat["counted_gemm_flops"] == pf["counted_gemm_flops"]


def test_both_cell_kinds_run_a_registered_contender_through_the_one_loop(test_systems):
    """A single-group cell and a data-parallel step cell (two groups, here on one process) both call the
    contender's ``step`` in the same order (one loop): a newly registered contender runs on ranks too."""
    for groups, counted in ((None, ["rec_a", "rec_b"]), (2, [])):  # the data-parallel step counts no FLOPs
        Recorder.log = []
        records = measure_cell(_cell(["rec_a", "rec_b"], repeats=1, groups=groups))
        assert [r["status"] for r in records] == ["ok", "ok"], [r["error"] for r in records]
        # warm-up A B, repeat B A, memory A B, then the FLOP-counting step
        expected = ["rec_a", "rec_b", "rec_b", "rec_a", "rec_a", "rec_b", *counted]
        assert [name for name, _, _ in Recorder.log] == expected, groups
    assert records[0]["groups_per_step"] == 2 and records[0]["grad_sync"]  # the data-parallel step's columns


def test_multi_group_records_model_the_whole_step():
    """A step of two groups (the multi-rank runner, here on one process) models both groups' FLOPs."""
    one = {r["system"]: r for r in measure_cell(_cell(["baseline", "prefixflow"], repeats=1))}
    two = {r["system"]: r for r in measure_cell(_cell(["baseline", "prefixflow"], repeats=1, groups=2))}
    for name in ("baseline", "prefixflow"):
        assert two[name]["status"] == "ok", two[name]["error"]
        assert two[name]["groups_per_step"] == 2
        assert two[name]["model_flops"] == 2 * one[name]["model_flops"] > 0, name
        assert two[name]["ideal_speedup"] == pytest.approx(one[name]["ideal_speedup"])
    assert two["prefixflow"]["attention"] == "split" and two["baseline"]["attention"] is None


def test_auto_microbatch_cells_are_validated_and_record_their_plan():
    with pytest.raises(ValueError, match="needs a memory_budget"):
        _cell(["prefixflow"], microbatch="auto")
    with pytest.raises(ValueError, match="needs a memory_budget"):
        _cell(["prefixflow"], microbatch=1, memory_budget=1 << 20)
    with pytest.raises(ValueError, match="names a system the cell does not run"):
        _cell(["prefixflow"], microbatch="auto", memory_budget="peak:baseline")
    with pytest.raises(ValueError, match="one group per step"):
        _cell(["prefixflow"], microbatch="auto", memory_budget=1 << 20, groups=2)
    with pytest.raises(ValueError, match="itself runs microbatch 'auto'"):
        _cell(["baseline", "prefixflow"], microbatch="auto", memory_budget="peak:baseline")
    peer = "peak:prefix_grouper"
    cell = _cell(  # unequal lengths: the pad slots, so the modelled FLOPs, depend on the plan's sizes
        ["prefixflow", "prefix_grouper"],
        microbatch="auto",
        memory_budget=peer,
        n=8,
        repeats=1,
        suffix_spread=0.5,
        suffix_len=8,
        seed=1,
    )
    records = {r["system"]: r for r in measure_cell(cell)}
    pf, pg = records["prefixflow"], records["prefix_grouper"]
    assert pf["status"] == pg["status"] == "ok", pf["error"]
    assert pf["microbatch_auto"] and pf["memory_budget"] == peer and pf["memory_budget_bytes"] > 0
    sizes = [int(b) for b in pf["microbatch_sizes"].split(",")]
    assert sum(sizes) == 8 and max(sizes) > 1  # the budget bought larger microbatches
    assert pf["peak_mem_bytes"] <= pf["memory_budget_bytes"]
    assert pf["model_flops"] == pf["counted_flops"]  # the modelled microbatches are the ones the plan ran


def test_memory_is_metered_apart_from_flop_counting_so_checkpointing_saves_what_it_saves():
    """FlopCounterMode keeps tensors alive that activation checkpointing frees: a peak metered under it puts
    full AC above no AC. The loop meters memory in a step of its own (and still counts the FLOPs)."""
    model = ModelSpec(
        name="llama3:debugmodel", overrides={"dim": 64, "n_layers": 2, "n_heads": 2, "vocab_size": 128}
    )
    peaks = {}
    for ac in ("none", "full"):
        cell = _cell(["baseline", "prefixflow"], model=model, prefix_len=128, suffix_len=32, warmup=0, repeats=1,
                     ac=ac, microbatch=1)  # fmt: skip
        for rec in measure_cell(cell):
            assert rec["status"] == "ok" and rec["counted_flops"] > 0, rec["error"]
            peaks[ac, rec["system"]] = rec["peak_mem_bytes"]
    for system in ("baseline", "prefixflow"):
        assert peaks["full", system] < peaks["none", system], peaks
