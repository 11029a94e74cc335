"""harness/simulate/pipeline.py: the discrete-event pipeline and CP model (no timing claims here: those live in records)."""

from __future__ import annotations

import pytest

from harness.costmodel.shape import ModelShape
from harness.simulate import pipeline as sim
from harness.simulate.cp import simulate_cp_phase_b


def _unit_costs(n_stages: int, n_mb: int, a=1.0, f=1.0, b=2.0, c=2.0, msg=0.0) -> sim.PipelineCosts:
    return sim.PipelineCosts(
        forward=[[f] * n_mb for _ in range(n_stages)],
        backward=[[b] * n_mb for _ in range(n_stages)],
        prefix_forward=[a] * n_stages,
        prefix_backward=[c] * n_stages,
        message=[msg] * n_mb,
        prefix_message=msg,
    )


def test_barrier_step_is_the_sum_of_three_drained_pipelines():
    n, m = 4, 6
    res = sim.simulate_pipeline(_unit_costs(n, m), "barrier")
    # A flows through n stages; 1F1B of m microbatches takes (m + n - 1) * (f + b); C flows back up.
    assert res.span_s == pytest.approx(n * 1.0 + (m + n - 1) * 3.0 + n * 2.0)


def test_stage_local_gap_to_barrier_does_not_grow_with_n():
    gaps = []
    for m in (2, 4, 8, 16, 32):
        costs = _unit_costs(4, m, msg=0.1)
        local = sim.simulate_pipeline(costs, "stage_local").span_s
        barrier = sim.simulate_pipeline(costs, "barrier").span_s
        assert local < barrier
        gaps.append(barrier - local)
    assert max(gaps[1:]) - min(gaps[1:]) < 1e-9  # fixed once the pipeline has at least n microbatches


def test_stages_sharing_one_core_finish_overlapped_work_no_sooner():
    costs = _unit_costs(2, 4, msg=0.0)
    work = 2 * (1.0 + 2.0) + 2 * 4 * (1.0 + 2.0)  # every operation of both stages
    for switching in ("stage_local", "barrier"):
        assert sim.simulate_pipeline(costs, switching, cores=1).span_s == pytest.approx(work)
        # as many cores as stages: the dedicated-core model
        ded = sim.simulate_pipeline(costs, switching)
        assert sim.simulate_pipeline(costs, switching, cores=2).span_s == pytest.approx(ded.span_s)
    local = sim.simulate_pipeline(costs, "stage_local", cores=1.5).span_s
    barrier = sim.simulate_pipeline(costs, "barrier", cores=1.5).span_s
    dedicated_gap = (
        sim.simulate_pipeline(costs, "barrier").span_s - sim.simulate_pipeline(costs, "stage_local").span_s
    )
    assert 0 < barrier - local < dedicated_gap  # a shared core takes part of the overlap's gain away


def test_simulated_timelines_follow_the_stage_programs_and_dependencies():
    from prefixflow.parallel.pp import stage_program

    res = sim.simulate_pipeline(_unit_costs(3, 4, msg=0.5), "stage_local")
    for s, events in enumerate(res.timelines):
        assert [(e["op"],) if e["mb"] is None else (e["op"], e["mb"]) for e in events] == stage_program(
            "stage_local", 3, s, 4, True
        )
    ends = {(e["op"], e["stage"], e["mb"]): e for events in res.timelines for e in events}
    for (op, s, mb), e in ends.items():
        if op in ("A", "F") and s > 0:
            assert e["start"] >= ends[(op, s - 1, mb)]["end"] + 0.5
        if op in ("B", "C") and s < 2:
            assert e["start"] >= ends[(op, s + 1, mb)]["end"] + 0.5
    assert all(b >= 0 for b in res.bubbles)


def test_baseline_programs_have_no_prefix_phases():
    costs = _unit_costs(2, 3)
    local = sim.simulate_pipeline(costs, "stage_local", prefix=False)
    barrier = sim.simulate_pipeline(costs, "barrier", prefix=False)
    assert local.span_s == barrier.span_s == pytest.approx((3 + 1) * 3.0)


def test_cp_prefetch_leaves_only_the_first_layer_on_demand():
    kwargs = dict(n_microbatches=4, gather_s=0.5, scatter_s=0.1)
    fwd, bwd = [1.0] * 8, [2.0] * 8
    demand = simulate_cp_phase_b(fwd, bwd, prefetch=False, **kwargs)
    ahead = simulate_cp_phase_b(fwd, bwd, prefetch=True, **kwargs)
    assert demand["demand_gathers"] == 32 and demand["prefetched_gathers"] == 0
    assert ahead["demand_gathers"] == 4 and ahead["prefetched_gathers"] == 28
    assert ahead["exposed_s"] == pytest.approx(4 * 0.5 + 32 * 0.1)
    assert ahead["overlapped_s"] == pytest.approx(28 * 0.5)
    assert ahead["phase_b_s"] < demand["phase_b_s"]
    slow = simulate_cp_phase_b(fwd, bwd, prefetch=True, n_microbatches=1, gather_s=3.0, scatter_s=0.0)
    assert slow["exposed_s"] == pytest.approx(3.0 + 7 * 2.0)  # a gather longer than a layer is partly exposed


def test_pipeline_costs_group_layers_into_stages_and_the_head_joins_the_last():
    fwd, bwd = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], [[2.0, 4.0], [6.0, 8.0], [10.0, 12.0]]
    costs = sim.LayerCosts([0.5, 0.7], [1.0, 1.4], fwd, bwd, [0.25] * 3, [0.5] * 3)
    stages = sim.pipeline_costs(costs, [[0], [1]], message_s=0.001)
    assert stages.n_stages == 2 and stages.n_microbatches == 3
    assert stages.forward[0][0] == pytest.approx(costs.forward[0][0])
    assert stages.forward[1][0] == pytest.approx(costs.forward[0][1] + costs.head_forward[0])


def test_flop_costs_scale_with_the_work():
    shape = ModelShape(4096, 32, 32, 8, 128, 14336, 128256)
    one = sim.flop_layer_costs(shape, 4096, 4096, 8, flops_per_s=1e14)
    two = sim.flop_layer_costs(shape, 4096, 4096, 8, flops_per_s=1e14, tp=2)
    assert len(one.forward) == 8 and one.n_layers == 32
    assert two.forward[0][0] == pytest.approx(one.forward[0][0] / 2)
    assert one.prefix_backward[0] == pytest.approx(2 * one.prefix_forward[0])


def test_paper_scale_panels_are_simulated_records_that_figure_6_draws(tmp_path):
    import pandas as pd

    from harness.figures.fig6 import cp_breakdown, figure6a, figure6b, pp_gaps
    from harness.simulate.claim1 import paper_cp_records, paper_pp_records

    df = pd.DataFrame(paper_pp_records(ns=(4, 8, 16)) + paper_cp_records())
    assert set(df["source"]) == {"simulated"}
    gaps = pp_gaps(df)
    assert set(gaps["panel"].str.startswith("simulated")) == {True}
    for _, g in gaps.groupby("panel"):
        assert (g["gap_s"] > 0).all() and g["gap_s"].max() - g["gap_s"].min() < 0.01 * g["gap_s"].mean()
    cp = cp_breakdown(df).set_index("mode")
    assert cp.loc["on demand", "demand_gathers"] == 16 * 32
    assert cp.loc["prefetch", "demand_gathers"] == 16  # the first layer of each suffix microbatch
    assert cp.loc["prefetch", "exposed_s"] < cp.loc["on demand", "exposed_s"]
    paths = figure6a(df, tmp_path) + figure6b(df, tmp_path)
    assert [p.name for p in paths] == ["fig6a_cp_prefetch.png", "fig6b_pp_switching.png"]


def test_cp_validation_predicts_the_prefetch_run_from_the_on_demand_run():
    import pandas as pd

    from harness.simulate.validate import validate_records

    common = dict(
        cell_id="c1", status="ok", cp=2, pp=1, n=4, microbatch=1, n_layers=2, prefix_len=64, suffix_len=16
    )
    demand = dict(common, system="prefixflow_cp_demand", phase_b_s=1.0, cp_exposed_s=0.2, cp_gather_wait_s=0.16,
                  cp_scatter_s=0.04, cp_demand_gathers=8, cp_scatters=8, cp_sequence_phase_b_s=0.1)  # fmt: skip
    ahead = dict(common, system="prefixflow", phase_b_s=0.9, cp_exposed_s=0.1, cp_gather_wait_s=0.06,
                 cp_scatter_s=0.04, cp_demand_gathers=4, cp_scatters=8, cp_sequence_phase_b_s=0.1)  # fmt: skip
    table3 = dict(common, cell_id="a1", system="prefixflow", pp=2, cp=2, quantity="G", phase_b_s=None)
    rows = validate_records(pd.DataFrame([demand, ahead, table3]))  # an alignment row is no timing
    assert [r["quantity"] for r in rows] == ["phase_b_s", "cp_exposed_s"] and rows[0]["measured_s"] == 0.9
    # compute 0.7 s + 4 first-layer gathers (0.02 s each) + 8 scatters (0.005 s) + sequence 0.1 s
    assert rows[0]["predicted_s"] == pytest.approx(0.7 + 4 * 0.02 + 8 * 0.005 + 0.1)
    assert rows[1]["predicted_s"] == pytest.approx(4 * 0.02 + 8 * 0.005) and rows[1]["measured_s"] == 0.1


def test_simulator_validation_rows_are_not_table3_rows():
    import pandas as pd

    from harness.run.alignment import alignment_rows

    table3 = dict(cell_id="a1", status="ok", system="prefixflow", quantity="G", step=1.0, microbatch=1.0,
                  model="m", layout="padded", ac="none", parallel_layout="cp2", dtype="fp64", run="prefixflow",
                  max_abs_diff=0.0, max_abs_value=1.0, passed=True)  # fmt: skip
    check = dict(cell_id="v1", status="ok", system="prefixflow", source="simulator-validation",
                 quantity="step_time_s", measured_s=1.0, predicted_s=1.1)  # fmt: skip
    measurements, rows = alignment_rows(pd.DataFrame([table3, check]))
    assert rows["quantity"].tolist() == ["G"] and rows["step"].tolist() == [1]
    assert measurements["cell_id"].tolist() == ["v1"]


def _family(per_layer: dict, n_layers: int = 4, pp: int = 2, ns=(2, 4, 8), msg: float = 0.01):
    """Records of one Figure 6b family whose timelines and step times come from the simulator itself."""
    import json

    import pandas as pd

    from harness.simulate.claim1 import stage_layers

    stages = stage_layers(pp, n_layers)
    recs = []
    for n in ns:
        layers = sim.LayerCosts(
            [per_layer["A"]] * n_layers, [per_layer["C"]] * n_layers, [[per_layer["F"]] * n_layers] * n,
            [[per_layer["B"]] * n_layers] * n, [0.0] * n, [0.0] * n,
        )  # fmt: skip
        costs = sim.pipeline_costs(layers, stages, message_s=msg, prefix_message_s=msg)
        for system, switching in (("prefixflow", "stage_local"), ("prefixflow_pp_barrier", "barrier")):
            res = sim.simulate_pipeline(costs, switching)
            steps = json.dumps([json.dumps(res.timelines)] * 3)
            recs.append(dict(cell_id=f"c{n}", status="ok", system=system, model="m", layout="padded",
                             dtype="fp32", ac="none", prefix_len=64, suffix_len=32, microbatch=1, pp=pp, tp=1,
                             cp=1, n=n, n_layers=n_layers, step_time_s=res.span_s, pp_timelines_steps=steps,
                             pp_timelines=json.dumps(res.timelines)))  # fmt: skip
    return pd.DataFrame(recs)


def test_pp_validation_predicts_each_run_from_the_others():
    import json

    from harness.simulate.validate import validate_records

    df = _family(dict(A=0.3, F=0.1, B=0.2, C=0.5))
    rows = validate_records(df)
    assert len(rows) == 6 and {r["quantity"] for r in rows} == {"step_time_s"}
    for r in rows:  # the simulator reproduces its own runs, and no run is calibrated on itself
        assert r["sim_error"] < 1e-9 and r["sim_load"] == pytest.approx(1.0), r
        assert r["sim_cores"] != r["sim_cores"]  # dedicated cores (NaN) fit runs simulated with them
        assert f"{r['system']} n={r['n']}" not in r["calibrated_on"].split(", ")
    # a run's own timelines do not enter its prediction: spoil them and its predicted time stays put, while
    # the run calibrated on them moves (two runs: each is the other's only calibration)
    pair = df[df["n"] == 4].reset_index(drop=True)
    slow = [[{**e, "end": e["start"] + (10 if e["op"] == "F" else 1) * (e["end"] - e["start"])} for e in ev]
            for ev in json.loads(pair.loc[0, "pp_timelines"])]  # slower forwards (a uniform factor calibrates away)  # fmt: skip
    spoiled = pair.copy()
    spoiled.loc[0, "pp_timelines_steps"] = json.dumps([json.dumps(slow)] * 3)
    before, after = validate_records(pair), validate_records(spoiled)
    assert after[0]["predicted_s"] == pytest.approx(before[0]["predicted_s"])
    assert after[1]["sim_error"] > 0.01


def test_pp_validation_fits_the_cores_the_stages_shared():
    import json

    from harness.simulate.claim1 import stage_layers
    from harness.simulate.validate import timeline_costs, validate_records

    df = _family(dict(A=0.3, F=0.1, B=0.2, C=0.5))
    stages = stage_layers(2, 4)
    for i, rec in df.iterrows():  # rerun every record's schedule with the two stages on one core
        n = int(rec["n"])
        layers = sim.LayerCosts([0.3] * 4, [0.5] * 4, [[0.1] * 4] * n, [[0.2] * 4] * n, [0.0] * n, [0.0] * n)
        costs = sim.pipeline_costs(layers, stages, message_s=0.01, prefix_message_s=0.01)
        switching = "barrier" if rec["system"] == "prefixflow_pp_barrier" else "stage_local"
        res = sim.simulate_pipeline(costs, switching, cores=1)
        df.loc[i, "step_time_s"] = res.span_s
        df.loc[i, "pp_timelines_steps"] = json.dumps([json.dumps(res.timelines)])
    steps = [json.loads(t) for t in json.loads(df.loc[0, "pp_timelines_steps"])]
    assert timeline_costs(steps, 4, 1, cores=1)[0].forward[0] == pytest.approx([0.1] * 4)  # work, not seconds
    rows = validate_records(df)
    assert all(r["sim_cores"] == 1 and r["sim_error"] < 1e-6 for r in rows), rows


def test_timeline_costs_share_a_stage_between_its_layers_and_find_the_message_latency():
    import json

    from harness.simulate.validate import timeline_costs

    df = _family(dict(A=0.3, F=0.1, B=0.2, C=0.5), n_layers=4, ns=(4,), msg=0.02)
    steps = [json.loads(t) for t in json.loads(df.loc[0, "pp_timelines_steps"])]
    layers, message = timeline_costs(steps, 4, 4)
    assert layers.prefix_forward == pytest.approx([0.3] * 4) and layers.forward[3] == pytest.approx([0.1] * 4)
    assert layers.prefix_backward == pytest.approx([0.5] * 4) and layers.backward[0] == pytest.approx(
        [0.2] * 4
    )
    assert message == pytest.approx(0.02)


def test_figure6b_gap_noise_pairs_the_systems_steps():
    import json

    from harness.figures.fig6 import pp_gaps

    df = _family(dict(A=0.3, F=0.1, B=0.2, C=0.5), ns=(4,))
    df["source"], df["device"] = "measured", "cpu"
    local = df["system"] == "prefixflow"
    one = json.loads(df.loc[local, "pp_timelines_steps"].iloc[0])
    slower = [json.dumps([[{**e, "end": e["end"] + 0.5} for e in ev] for ev in json.loads(t)]) for t in one]
    df.loc[local, "pp_timelines_steps"] = json.dumps([one[0], slower[1], one[2], slower[0]])  # 4 paired steps
    row = pp_gaps(df).iloc[0]
    gap = row["gap_s"]  # from the medians (the records' step times)
    # the per-step gaps are gap, gap - 0.5, gap (the 4th step has no barrier partner): quartiles of those
    assert row["gap_q25_s"] == pytest.approx(gap - 0.5) and row["gap_q75_s"] == pytest.approx(gap)
