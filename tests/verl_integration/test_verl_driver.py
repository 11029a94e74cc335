"""The verl driver (``python -m harness.rl.verl_driver``), 2 steps: verl's engine and PrefixFlow's from the
same weights and seed draw the same step-1 generations and rewards, log verl's timing keys, end step 1 with
the same weights (fp32, AdamW), and their logs become pf-bench records that Figures 7 and 8a draw."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("verl", minversion="0.9")

import verl_cpu  # noqa: E402, F401  (selects the CPU platform before verl's engines import)

from harness.peers.verl_loop import TIMING_KEYS, DriverConfig, run_driver  # noqa: E402

SMALL = dict(steps=2, prompts_per_step=2, n=4, facts=10, response_length=6, hidden=32, micro_batch=4)


@pytest.fixture(scope="module")
def driven(tmp_path_factory):
    out = tmp_path_factory.mktemp("verl-driver")
    run_driver(DriverConfig(**SMALL), out, log=lambda msg: None)
    logs = {
        e: [json.loads(x) for x in (out / f"{e}.jsonl").read_text().splitlines()]
        for e in ("verl", "prefixflow")
    }
    return out, logs


def test_both_engines_log_verls_timing_keys_and_start_from_the_same_rollout(driven):
    out, logs = driven
    verl, ours = logs["verl"], logs["prefixflow"]
    assert [r["step"] for r in verl] == [r["step"] for r in ours] == [1, 2]
    for r in verl + ours:
        parts = sum(r[f"timing_s/{k}"] for k in TIMING_KEYS if k != "step")
        assert all(r[f"timing_s/{k}"] > 0 for k in TIMING_KEYS), r
        assert parts <= r["timing_s/step"] * 1.001, r  # verl's step timer holds the others
        assert r["rows"] == 2 * 4
    # same weights and seed: the same samples and rewards at step 1
    assert ours[0]["responses_sha"] == verl[0]["responses_sha"]
    assert ours[0]["critic/score/mean"] == verl[0]["critic/score/mean"]
    assert ours[0]["actor/pg_loss_sum"] == pytest.approx(verl[0]["actor/pg_loss_sum"], rel=1e-5, abs=1e-7)
    div = [json.loads(x) for x in (out / "divergence.jsonl").read_text().splitlines()]
    assert div[0]["step"] == 1 and div[0]["drift_a"] > 0
    assert div[0]["max_rel"] < 1e-4, div[0]  # fp32 through AdamW (measured 6e-6); the update is 1e-3 of w


def test_logs_become_records_that_the_figures_draw(driven, tmp_path):
    from harness.figures.fig7 import figure7_verl, speedups, verl_rows
    from harness.figures.fig8 import figure8a_verl
    from harness.records import collect
    from harness.rl.verl_driver import write_driver_records

    out, logs = driven
    write_driver_records(out)  # read_records' verification runs in collect
    df = collect(out, problems=(problems := []))
    assert not problems
    steps = df[df["record_kind"] == "rl_step"].set_index(["system", "step"])
    assert len(steps) == 4 and (df["record_kind"] == "rl_divergence").sum() == 2
    raw = logs["verl"][1]
    row = steps.loc[("baseline", 2)]
    assert row["evaluation_s"] == pytest.approx(raw["timing_s/old_log_prob"] + raw["timing_s/ref"])
    assert row["update_s"] == raw["timing_s/update_actor"] and row["step_s"] == raw["timing_s/step"]
    assert row["reward_mean"] == raw["critic/score/mean"]
    sp = speedups(verl_rows(df))
    assert sp["update_speedup"] == pytest.approx(
        raw["timing_s/update_actor"] / logs["prefixflow"][1]["timing_s/update_actor"]
    )
    made = figure7_verl(df, tmp_path) + figure8a_verl(df, tmp_path)
    assert [p.name for p in made] == ["fig7_verl_step_breakdown.png", "fig8a_verl_training_quality.png"]


def test_bad_settings_and_missing_logs_refused_in_one_line(tmp_path):
    from harness.rl.verl_driver import driver_records, main

    with pytest.raises(ValueError, match=r"^n=0: must be at least 1$"):
        DriverConfig(n=0)
    with pytest.raises(ValueError, match=r"mini_batches=3: must divide prompts_per_step"):
        DriverConfig(mini_batches=3)
    with pytest.raises(ValueError, match=r"config.json: missing; run `python -m harness.rl.verl_driver"):
        driver_records(tmp_path)
    assert main(["--out", str(tmp_path), "--records-only"]) == 2
