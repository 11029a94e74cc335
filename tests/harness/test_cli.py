"""pf-bench end to end: smoke sweep (once per module), rerun, status, collect, run, errors, lazy commands."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pandas as pd
import pytest
import torch
from support import REPO
from typer.testing import CliRunner

import harness
from harness.cli import app
from harness.cli.common import parse_overrides
from harness.records import COLUMNS, collect
from harness.spec.cell import report_steps_for
from harness.spec.load import expand, load_spec

SMOKE = REPO / "experiments" / "smoke.yaml"
runner = CliRunner()
TINY_RUN = [
    "--model",
    "llama3:debugmodel",
    "--override",
    "dim=32",
    "--override",
    "n_heads=2",
    "--override",
    "n_layers=2",
    "--override",
    "vocab_size=128",
    "--prefix-len",
    "12",
    "--suffix-len",
    "4",
    "--n",
    "2",
    "--warmup",
    "0",
    "--repeats",
    "1",
]


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smoke")
    res = invoke("sweep", SMOKE, "--out", out)
    assert res.exit_code == 0, res.output
    return out


@pytest.mark.slow
def test_smoke_sweep_records_every_cell_and_system(smoke):
    cells = expand(load_spec(SMOKE))
    df = collect(smoke)
    assert sorted(df["cell_id"].unique()) == sorted(c.cell_id for c in cells)
    assert set(df["system"]) == {"baseline", "prefixflow"} and len(df) == 2 * len(cells)
    assert set(df["status"]) == {"ok"}, df[["cell_id", "system", "error"]]
    assert set(COLUMNS) <= set(df.columns)
    assert set(df["layout"]) == {"padded", "packed"} and (df["step_time_s"] > 0).all()
    assert (df["step_time_min_s"] <= df["step_time_s"]).all() and (
        df["step_time_s"] <= df["step_time_max_s"]
    ).all()
    assert df["git_rev"].str.len().gt(0).all() and (df["repeats"] == 3).all()


@pytest.mark.slow
def test_second_sweep_runs_nothing_and_status_says_so(smoke):
    before = {p: p.stat().st_mtime_ns for p in (smoke / "smoke").glob("*.parquet")}
    res = invoke("sweep", SMOKE, "--out", smoke)
    assert res.exit_code == 0 and "0 to run" in res.output and "ran 0" in res.output
    assert {p: p.stat().st_mtime_ns for p in (smoke / "smoke").glob("*.parquet")} == before
    res = invoke("status", smoke)
    assert res.exit_code == 0 and "a sweep would run nothing" in res.output
    res = invoke("sweep", SMOKE, "--out", smoke, "--dry-run")
    assert res.exit_code == 0 and "0 to run" in res.output and "done (ok)" in res.output


@pytest.mark.slow
def test_collect_writes_one_table(smoke, tmp_path):
    out = tmp_path / "all.parquet"
    res = invoke("collect", smoke, "-o", out)
    assert res.exit_code == 0, res.output
    assert len(pd.read_parquet(out)) == 2 * len(expand(load_spec(SMOKE)))


@pytest.mark.slow
def test_figures_and_tables_call_the_renderers(smoke, tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("harness.figures")
    fake.render_all = lambda df, out: calls.append(("figures", len(df), out)) or [out / "fig.png"]
    fake.render_tables = lambda df, out: calls.append(("tables", len(df), out)) or [out / "t.md"]
    monkeypatch.setitem(sys.modules, "harness.figures", fake)
    # `import harness.figures as f` reads the package attribute once the real module was imported (e.g. by
    # collecting tests/harness/test_figures.py in the same session), so patch that too
    monkeypatch.setattr(harness, "figures", fake, raising=False)
    assert invoke("figures", "--results", smoke, "--out", tmp_path / "f").exit_code == 0
    assert invoke("tables", "--results", smoke, "--out", tmp_path / "f").exit_code == 0
    n = 2 * len(expand(load_spec(SMOKE)))
    assert calls == [("figures", n, tmp_path / "f"), ("tables", n, tmp_path / "f")]
    res = runner.invoke(app, ["figures", "--results", str(tmp_path / "empty"), "--out", str(tmp_path)])
    assert res.exit_code == 2 and "no records" in res.output


def test_dry_run_on_empty_folder_lists_cells(tmp_path):
    res = invoke("sweep", SMOKE, "--out", tmp_path, "--dry-run")
    n = len(expand(load_spec(SMOKE)))
    assert res.exit_code == 0 and f"{n} to run" in res.output
    assert not (tmp_path / "smoke").exists()


def test_malformed_spec_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(SMOKE.read_text().replace("layout: [padded, packed]", "layout: [padded, diagonal]"))
    res = runner.invoke(app, ["sweep", str(bad), "--out", str(tmp_path)])
    assert res.exit_code == 2
    assert "bad.yaml" in res.output and "axes.layout.1" in res.output and "'padded' or 'packed'" in res.output


def test_run_json_prints_one_record_per_system(tmp_path):
    res = invoke("run", *TINY_RUN, "--layout", "packed", "--json", "--out", tmp_path)
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    assert [r["system"] for r in lines] == ["baseline", "prefixflow"]
    assert all(r["status"] == "ok" and r["layout"] == "packed" and r["n"] == 2 for r in lines)
    assert lines[0]["phase_a_s"] is None and lines[1]["phase_a_s"] > 0
    files = list((tmp_path / "adhoc").glob("*.parquet"))
    assert len(files) == 1 and files[0].stem == lines[0]["cell_id"]


def test_run_table_and_failures_exit_nonzero():
    res = invoke("run", *TINY_RUN, "--systems", "prefixflow")
    assert res.exit_code == 0 and "prefixflow" in res.output and "cpu-live-bytes" in res.output
    res = runner.invoke(app, ["run", *TINY_RUN, "--systems", "prefixflow,nosuch"])
    assert res.exit_code == 2 and "unknown system 'nosuch'" in res.output  # before anything runs
    res = runner.invoke(app, ["run", *TINY_RUN, "--systems", "prefixflow", "--device", "cuda"])
    assert res.exit_code == (0 if torch.cuda.is_available() else 1)  # a failing cell exits 1
    res = runner.invoke(app, ["run", *TINY_RUN, "--layout", "diagonal"])
    assert res.exit_code == 2


def test_parse_overrides():
    assert parse_overrides(["dim=64", "norm_eps=1e-5", "name=x", "flag=true"]) == {
        "dim": 64,
        "norm_eps": 1e-5,
        "name": "x",
        "flag": True,
    }
    with pytest.raises(Exception, match="FIELD=VALUE"):
        parse_overrides(["dim"])


@pytest.mark.slow
def test_align_runs_table3_on_a_tiny_model():
    res = invoke(
        "align",
        "--override",
        "dim=32",
        "--override",
        "n_heads=2",
        "--override",
        "n_layers=2",
        "--override",
        "vocab_size=128",
        "--steps",
        "2",
        "--dtype",
        "fp64",
        "--prefix-len",
        "10",
        "--suffix-len",
        "4",
        "--n",
        "2",
    )
    assert res.exit_code == 0, res.output
    assert "PASS" in res.output and "FAIL" not in res.output
    assert report_steps_for(2) == [1, 2] and report_steps_for(20) == [1, 10, 20]
    res = runner.invoke(app, ["align", "--steps", "1", "--prefix-len", "0", "--override", "dim=32"])
    assert res.exit_code != 0


def test_help_everywhere():
    for cmd in ([], ["run"], ["sweep"], ["status"], ["collect"], ["figures"], ["tables"], ["align"]):
        res = runner.invoke(app, [*cmd, "--help"])
        assert res.exit_code == 0 and "Usage" in res.output
    res = invoke("run", "--help")
    assert "--offload" in res.output and "--ac" in res.output and "--json" in res.output


def test_run_carries_microbatch_ac_and_offload_into_records():
    args = [a if a != "12" else "200" for a in TINY_RUN]  # a prefix long enough to have storages to move
    res = invoke("run", *args, "--microbatch", "1", "--ac", "selective", "--offload", "--json")
    assert res.exit_code == 0, res.output
    base, pf = (json.loads(x) for x in res.stdout.splitlines() if x.startswith("{"))
    assert base["microbatch"] == pf["microbatch"] == 1 and base["ac"] == pf["ac"] == "selective"
    assert pf["prefix_len"] == 200
    assert base["offload"] is False and base["offload_tier"] is None  # the baseline never offloads
    assert pf["offload"] is True and pf["offload_tier"] == "cpu-file"
    assert pf["offloaded_bytes"] > 0 and pf["demand_loaded_bytes"] >= 0
    assert pf["offloaded_bytes"] >= pf["prefetched_bytes"] + pf["demand_loaded_bytes"]


def test_claim4_dry_run_lists_frontier_searches(tmp_path):
    claim4 = REPO / "experiments" / "claim4.yaml"
    for preset in ("cpu", "paper"):
        cells = expand(load_spec(claim4, preset))
        searches = [c for c in cells if c.frontier is not None]
        assert [(c.systems, c.offload) for c in searches] == [
            (("baseline",), False), (("prefixflow",), False), (("prefixflow",), True),
        ] * 2  # fmt: skip
        assert [c.frontier.mode for c in searches] == ["ratio"] * 3 + ["prefix"] * 3
        assert {c.microbatch for c in cells if c.systems == ("prefixflow",) and c.frontier is None} == {
            1,
            2,
            4,
            8,
        }
    res = invoke("sweep", claim4, "--out", tmp_path, "--dry-run")
    assert res.exit_code == 0 and "frontier ratio 0.833" in res.output and "256 MiB" in res.output


def test_align_writes_rows_that_tables_render_as_table3(tmp_path):
    import pandas as pd

    from harness.figures import render_tables

    res = invoke(
        "align", "--dtype", "fp32", "--steps", "2", "--prefix-len", "9", "--suffix-len", "4", "--n", "2",
        "--override", "dim=32", "--override", "n_layers=1", "--override", "n_heads=2",
        "--override", "vocab_size=64", "--microbatch", "1", "--controls", "--out", tmp_path,
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    files = list((tmp_path / "_alignment").glob("*.parquet"))
    assert len(files) == 1
    rows = pd.read_parquet(files[0])
    assert set(rows["quantity"]) == {"G", "L", "W"} and set(rows["step"]) == {1, 2}
    correct = rows[rows["run"] == "prefixflow"]
    assert correct["pass"].all() and set(correct["dtype"]) == {"fp32"} and rows["git_rev"].notna().all()
    controls = rows[rows["run"] != "prefixflow"]
    assert set(controls["run"]) == {"phase_c_off", "gkv_x0.9", "rope_offset+1", "microbatch_loss_scale"}
    assert not controls.groupby(["run", "step"])["pass"].all().any()  # every control fails at every step
    made = render_tables(pd.DataFrame(), tmp_path / "t", alignment=tmp_path / "_alignment")
    assert any(p.name == "table3_alignment.md" for p in made)
