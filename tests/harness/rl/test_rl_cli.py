"""`pf-bench rl` / `replay` end to end: the smoke preset, its records and figures, resume, refusals."""

from __future__ import annotations

import statistics

import pandas as pd
import pytest
import torch
from support import REPO
from typer.testing import CliRunner

from harness.cli import app
from harness.records import collect, read_records
from harness.rl.spec import RL_PRESETS, load_rl_spec

CLAIM2 = REPO / "experiments" / "claim2.yaml"
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("preset", RL_PRESETS)
def test_claim2_presets_are_valid(preset):
    spec = load_rl_spec(CLAIM2, preset)
    if preset.startswith("multiturn"):  # issue 22: the tree trainer beside them, on one seed
        assert (
            spec.trainers == ["baseline", "prefixflow", "prefixflow_tree"] and spec.task.kind == "multiturn"
        )
        return
    assert spec.trainers == ["baseline", "prefixflow"] and spec.reference_seed is not None


def test_paper_preset_needs_its_gpus_and_says_where_to_run_it(tmp_path):
    spec = load_rl_spec(CLAIM2, "paper")
    assert spec.parallel.tp == 2 and spec.parallel.cp == 4 and spec.device == "cuda"
    if torch.cuda.device_count() >= spec.parallel.world_size:
        pytest.skip("this machine has the paper preset's GPUs")
    res = invoke("rl", CLAIM2, "--preset", "paper", "--out", tmp_path / "out")
    assert res.exit_code == 2
    assert "device 'cuda'" in res.output and "--executor slurm" in res.output, res.output
    assert "Traceback" not in res.output and not (tmp_path / "out").exists()


def test_bad_spec_names_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(CLAIM2.read_text().replace("  temperature: 1.0", "  temprature: 1.0"))
    res = invoke("rl", bad, "--out", tmp_path / "out")
    assert res.exit_code == 2 and "loop.temprature" in res.output and "unknown key" in res.output


@pytest.mark.slow
def test_smoke_preset_records_figures_and_resume(tmp_path):
    out = tmp_path / "results"
    res = invoke("rl", CLAIM2, "--preset", "smoke", "--out", out)
    assert res.exit_code == 0, res.output
    folder = out / "claim2" / "smoke"
    steps = {p.stem: read_records(p) for p in (folder / "records").glob("*.parquet")}
    assert sorted(steps) == ["baseline-s0", "baseline-s1", "prefixflow-s0", "prefixflow-s1", "trace-fp32-s0"]
    # every pair of the 2x2 (trainer x seed) runs at every checkpoint, the baseline first across systems
    div = read_records(folder / "divergence.parquet")
    pairs = {(r.pair, r.run_a, r.run_b) for r in div.itertuples()}
    assert pairs == {
        ("seed-change", "baseline-s0", "baseline-s1"),
        ("seed-change", "prefixflow-s0", "prefixflow-s1"),
        ("cross-system", "baseline-s0", "prefixflow-s0"),
        ("cross-system", "baseline-s1", "prefixflow-s1"),
        ("cross-system+seed", "baseline-s0", "prefixflow-s1"),
        ("cross-system+seed", "baseline-s1", "prefixflow-s0"),
    }
    assert sorted(div["step"].unique()) == [2, 4] and (div["rmse"] > 0).all()
    assert list(steps["prefixflow-s0"]["step"]) == [1, 2, 3, 4]
    for col in (
        "generation_s",
        "evaluation_s",
        "update_s",
        "sync_s",
        "reward_mean",
        "loss",
        "response_tokens",
    ):
        assert steps["baseline-s0"][col].notna().all()
    replays = sorted(p.name for p in folder.glob("replay-*.parquet"))
    assert sorted(replays) == sorted(
        [f"replay-baseline-{d}-s0-{s}.parquet" for d in ("bf16", "fp32") for s in ("baseline", "prefixflow")]
        + ["replay-baseline-fp32-s0-baseline-fp64.parquet"]  # the fp32 trace's own rounding (its floor)
    )
    assert (read_records(folder / "replay-baseline-fp32-s0-baseline.parquet")["max_abs"] == 0).all()
    floor = read_records(folder / "replay-baseline-fp32-s0-baseline-fp64.parquet")
    assert (floor["replay_dtype"] == "fp64").all() and (floor["max_abs"] > 0).all()
    assert len(list((folder / "_state" / "runs" / "baseline-s0" / "checkpoints").glob("*.safetensors"))) == 2
    # the Claim-3 reference times the suffix length the compared trainers ran (padded to each group's longest)
    ref = read_records(folder / "claim3-reference.parquet")
    loop = pd.concat([steps["baseline-s0"], steps["prefixflow-s0"]])
    for step, s in ref.groupby("step")["suffix_len"].first().items():
        window = loop[(loop["step"] > step - 2) & (loop["step"] <= step)]["padded_suffix_len_mean"]
        assert s == round(statistics.median(window.tolist())) and (ref["task_suffix_len"] == 5).all()
    # every figure comes from the records alone; other sweeps' figures ignore these rows
    res = invoke("figures", "--results", out, "--out", out / "figures")
    assert res.exit_code == 0, res.output
    made = {p.name for p in (out / "figures").iterdir()}
    assert {"fig7_step_breakdown.png", "fig8a_training_quality.png", "fig8b_trace_replay.png"} <= made
    assert "claim2_summary.md" in made and "smoke_overview.png" not in made
    from harness.figures.fig8 import divergence_ratios

    ratios = divergence_ratios(collect(out))  # collecting keeps every pair: two pairs, four ratios per kind
    assert {k: len(v) for k, (_, v) in ratios.items()} == {
        "seed-change": 4,
        "cross-system": 4,
        "cross-system+seed": 4,
    }
    summary = (out / "figures" / "claim2_summary.md").read_text()
    assert "cross-system, rollouts forked" in summary and "seed change (one trainer" in summary
    before = collect(out)
    res = invoke("rl", CLAIM2, "--preset", "smoke", "--out", out)  # resumable: nothing left to run
    assert res.exit_code == 0 and "step 2/" not in res.output and "warm start: 20 steps" not in res.output
    after = collect(out)
    kept = after[after["record_kind"] == "rl_step"]["timestamp"].sort_values().tolist()
    assert kept == before[before["record_kind"] == "rl_step"]["timestamp"].sort_values().tolist()


def test_rl_records_are_verified_records_kept_apart_by_preset(tmp_path):
    from harness.rl.io import write_rl_records

    def rows(preset):
        return [
            {"spec": "claim2", "system": "baseline", "status": "ok", "step": s, "preset": preset}
            | {"record_kind": "rl_step", "reward_mean": 0.1 * s, "timestamp": f"t{s}", "cell_id": "x"}
            for s in (1, 2)
        ]

    for preset in ("smoke", "cpu"):
        write_rl_records(
            tmp_path / "claim2" / preset / "records" / "baseline-s0.parquet", rows(preset), tmp_path
        )
    one = read_records(tmp_path / "claim2" / "cpu" / "records" / "baseline-s0.parquet")
    assert set(one["cell_id"]) == {"baseline-s0"}  # the file name, as read_records verifies
    df = collect(tmp_path)
    assert sorted(zip(df["preset"], df["step"], strict=True)) == [
        ("cpu", 1),
        ("cpu", 2),
        ("smoke", 1),
        ("smoke", 2),
    ]


def test_a_link_planted_in_out_is_refused_before_any_work(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out" / "claim2").mkdir(parents=True)
    (tmp_path / "out" / "claim2" / "smoke").symlink_to(elsewhere)
    res = invoke("rl", CLAIM2, "--preset", "smoke", "--out", tmp_path / "out")
    assert res.exit_code == 2 and "symbolic link" in res.output and "Traceback" not in res.output
    assert list(elsewhere.iterdir()) == []


def test_step_speedups_use_medians_cap_and_amdahl_at_the_measured_update_speedup():
    import pandas as pd

    from harness.figures.fig7 import amdahl, speedups

    rows = []
    for step in range(1, 8):
        spike = 50.0 if step == 5 else 0.0  # one load spike in one run: moves a mean, not a median
        for system, update, train in (("baseline", 3.0, 2.9), ("prefixflow", 1.0 + spike, 0.9)):
            rows.append(
                dict(
                    record_kind="rl_step",
                    status="ok",
                    preset="cpu",
                    identity="x",
                    timestamp=f"t{step}",
                    role="compare",
                    run=f"{system}-s0",
                    system=system,
                    step=step,
                    generation_s=0.5,
                    reward_s=0.0,
                    evaluation_s=0.5,
                    update_s=update,
                    sync_s=0.0,
                    step_s=1.0 + update,
                    update_train_s=train,
                )
            )
    sp = speedups(pd.DataFrame(rows))
    f = 3.0 / 4.0
    assert sp["update_share"] == pytest.approx(f)
    assert sp["update_speedup"] == pytest.approx(3.0) and sp["e2e_speedup"] == pytest.approx(2.0)
    assert sp["update_speedup_mean"] < 1.0  # the spike dominates a mean
    assert sp["amdahl_bound"] == pytest.approx(4.0)
    assert sp["amdahl_at_update_speedup"] == pytest.approx(1 / ((1 - f) + f / 3.0)) == pytest.approx(2.0)
    assert sp["e2e_over_amdahl"] == pytest.approx(1.0) and sp["e2e_over_bound"] == pytest.approx(0.5)
    assert sp["train_phases_speedup"] == pytest.approx(29 / 9)
    assert sp["update_outside_phases_s_prefixflow"] == pytest.approx(0.1)
    assert amdahl(0.5, 1.0) == 1.0
