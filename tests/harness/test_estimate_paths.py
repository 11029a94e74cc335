"""The estimate's surface (issue 34, item 1): ``pf-bench run --estimate``, ``pf-bench sweep --estimate`` and a
spec's ``executor: {kind: estimate}`` write records of the usual schema (``mem_meter = fake-live-bytes``);
the normal path imports nothing of ``harness.estimate``; a real tensor above 1 MiB, a value-dependent op and
a cell kind an estimate does not run are refused in one line naming the op or the field and the cell."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from support import REPO
from typer.testing import CliRunner

from harness.cli import app
from harness.estimate import estimate_cell
from harness.estimate.fake import RealTensorError, RealTensorGuard, fake_mode
from harness.figures.common import SkipFigure
from harness.records import collect
from harness.spec.cell import Cell, ModelSpec, Parallel
from harness.workloads import AgenticShape
from prefixflow import PrefixFlowConfig
from prefixflow.schedule.host import on_host

runner = CliRunner()
TINY = ["--model", "llama3:debugmodel", "--override", "dim=32", "--override", "n_heads=2", "--override",
        "n_layers=2", "--override", "vocab_size=128", "--prefix-len", "12", "--suffix-len", "4", "--n", "2"]  # fmt: skip
SPEC = """\
name: est
systems: [baseline, prefixflow]
warmup: 0
repeats: 1
axes:
  models:
    - {{name: "llama3:debugmodel", overrides: {{dim: 32, n_heads: 2, n_layers: 2, vocab_size: 128}}}}
  prefix_ratio: [0.75]
  total_len: [16]
  n: [2]
  offload: [false, true]
{executor}
"""


def _cell(**kw) -> Cell:
    base = dict(spec="est", model=ModelSpec(name="llama3:debugmodel", overrides={"dim": 32, "n_heads": 2,
                "n_layers": 2, "vocab_size": 128}), prefix_len=12, suffix_len=4, n=2, warmup=0, repeats=1,
                device="cpu")  # fmt: skip
    return Cell(**{**base, **kw})


def test_normal_path_imports_nothing_of_the_estimate():
    code = textwrap.dedent("""
        import sys
        import harness.cli, harness.cli.run, harness.cli.sweep, harness.execute.executors, harness.sweep
        from harness.execute.local import run_cell
        from harness.spec.cell import Cell, ModelSpec
        cell = Cell(spec="x", model=ModelSpec(name="llama3:debugmodel", overrides={"dim": 32, "n_heads": 2,
                    "n_layers": 2, "vocab_size": 128}), prefix_len=12, suffix_len=4, n=2, warmup=0, repeats=1,
                    device="cpu", offload=True)
        assert all(r["status"] == "ok" for r in run_cell(cell))
        loaded = sorted(m for m in sys.modules if m.startswith("harness.estimate"))
        print(loaded)
        assert not loaded, loaded
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def test_guard_refuses_a_real_tensor_above_1_mib_naming_the_op():
    with fake_mode(), RealTensorGuard():
        big = torch.zeros(1 << 20, dtype=torch.float64)  # fake: 8 MiB of nothing
        assert big.untyped_storage().device.type == "meta"
        with on_host():
            torch.zeros(1 << 17, dtype=torch.float64)  # real, exactly 1 MiB: allowed
            with pytest.raises(RealTensorError, match=r"aten\.ones\.default made a real tensor of 2\.0 MiB"):
                torch.ones(1 << 18, dtype=torch.float64)


def test_the_limit_grows_with_the_steps_tokens_by_their_index_bytes_only(monkeypatch):
    """A 128k-token group's ids may stay real (16 bytes a token); a real tensor of twice that is refused, and
    an estimate's guard takes the cell's tokens: the baseline's N x (P+S), plus P."""
    import harness.estimate.loop as loop
    from harness.estimate.fake import real_limit

    assert real_limit(1000) == 1 << 20 and real_limit(131072) == 16 * 131072
    with fake_mode(), RealTensorGuard(real_limit(131072)), on_host():
        torch.zeros(2 * 131072, dtype=torch.int64)  # ids and positions of every token: 2 MiB, allowed
        with pytest.raises(RealTensorError, match=r"of 4\.0 MiB during the estimate \(limit 2\.0 MiB\)"):
            torch.zeros(4 * 131072, dtype=torch.int64)
    limits = []
    monkeypatch.setattr(loop, "real_limit", lambda tokens: limits.append(tokens) or real_limit(tokens))
    assert all(r["status"] == "ok" for r in estimate_cell(_cell()))
    cell = _cell()
    assert limits == [cell.n * (cell.prefix_len + cell.suffix_len) + cell.prefix_len]


def test_a_layout_the_model_cannot_take_is_one_line_naming_the_cell():
    from harness.spec.cell import Parallel

    cell = _cell(parallel=Parallel(tp=4), systems=("baseline",))
    (rec,) = estimate_cell(cell)
    assert rec["status"] == "error" and "\n" not in rec["error"] and "Traceback" not in rec["error"]
    assert rec["error"].startswith(f"cell {cell.cell_id}: baseline: tp=4 must divide the model's n_heads=2")


def test_refused_in_one_line_naming_the_op_and_the_cell(monkeypatch):
    # A fake mask inspected as if it had values: the estimate must refuse, not guess.
    import prefixflow.attention.split as split

    monkeypatch.setattr(split, "has_values", lambda t: True)
    cell = _cell(layout="packed", systems=("baseline", "prefixflow"))
    base, pf = estimate_cell(cell)
    assert base["status"] == "ok"
    assert pf["status"] == "refused" and "\n" not in pf["error"]
    assert pf["error"].startswith(
        f"cell {cell.cell_id}: cannot be estimated: aten.equal.default reads tensor values"
    )
    assert "prefixflow/attention/split.py" in pf["error"]


_TREE = AgenticShape(system_len=32, turns=2, assistant_len=8, reply_len=8)


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"compile": True}, "compile: torch.compile cannot run"),
        (
            {"parallel": Parallel(dp_shard=2), "tree": _TREE, "layout": "packed"},
            "a tree on a layout of 2 ranks",
        ),
    ],
)
def test_kinds_not_estimated_are_refused_in_one_line(kw, why):
    cell = _cell(**kw)
    records = estimate_cell(cell)
    assert {r["status"] for r in records} == {"refused"}
    assert (
        records[0]["error"]
        == f"cell {cell.cell_id}: cannot be estimated: "
        + records[0]["error"].split("cannot be estimated: ", 1)[1]
    )
    assert why in records[0]["error"] and "\n" not in records[0]["error"]


def test_offload_tier_is_checked():
    with pytest.raises(
        ValueError, match=r"PrefixFlowConfig.offload_tier 'disk' unknown; valid: \('auto', 'fake'\)"
    ):
        PrefixFlowConfig(offload=True, offload_tier="disk")


def test_run_estimate_json(tmp_path):
    result = runner.invoke(app, ["run", *TINY, "--estimate", "--offload", "--json", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["system"] for r in rows] == ["baseline", "prefixflow"]
    for r in rows:
        assert r["status"] == "ok" and r["mem_meter"] == "fake-live-bytes" and r["counted_flops"] > 0
        assert r["step_time_s"] is None and r["peak_mem_bytes"] > 0
    pf = rows[1]
    assert pf["offload_tier"] == "fake" and pf["offloaded_bytes"] > 0
    assert pf["peak_mem_phase_a_bytes"] > 0 and pf["peak_mem_phase_c_bytes"] > 0
    df = collect(tmp_path)  # the written record verifies like any other (ok rows: no NaN)
    assert set(df["mem_meter"]) == {"fake-live-bytes"}


def test_run_estimate_refuses_in_one_line():
    result = runner.invoke(app, ["run", *TINY, "--estimate", "--compile"])
    assert result.exit_code == 2  # a user error, as every refused option
    assert "cannot be estimated: compile" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("how", ["flag", "spec"])
def test_sweep_estimate(tmp_path, how):
    spec = tmp_path / "est.yaml"
    spec.write_text(SPEC.format(executor="executor: {kind: estimate, max_jobs: 1}" if how == "spec" else ""))
    args = ["sweep", str(spec), "--out", str(tmp_path / "out")]
    args += ["--estimate", "--executor", "debug"] if how == "flag" else []  # spec: worker subprocesses
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    df = collect(tmp_path / "out")
    assert len(df) == 4 and set(df["status"]) == {"ok"} and set(df["mem_meter"]) == {"fake-live-bytes"}
    tiers = df[(df["system"] == "prefixflow") & df["offload"]]["offload_tier"]
    assert list(tiers) == ["fake"]
    if how == "flag":  # estimate records have their own figure; the measured ones never read them
        from harness.figures.fig10 import figure10a
        from harness.figures.paper_scale import figure10a_paper

        assert [p.name for p in figure10a_paper(df, tmp_path / "figs")] == ["fig10a_paper_scale.png"]
        with pytest.raises(SkipFigure):
            figure10a(df, tmp_path / "figs")
        # a cell id does not say it was estimated: a measured sweep refuses the folder, an estimate resumes it
        measured = runner.invoke(
            app, ["sweep", str(spec), "--out", str(tmp_path / "out"), "--executor", "debug"]
        )
        assert measured.exit_code == 2 and "is recorded estimated; a measured sweep needs its own --out" in (
            measured.output
        ), measured.output
        again = runner.invoke(app, args)
        assert again.exit_code == 0 and "2 recorded, 0 to run" in again.output, again.output
        # --dry-run plans as the sweep would: the estimates are done, and a measured plan is refused in one line
        dry = runner.invoke(app, [*args, "--dry-run"])
        assert dry.exit_code == 0 and dry.output.count("done (ok)") == 2, dry.output
        dry = runner.invoke(app, ["sweep", str(spec), "--out", str(tmp_path / "out"), "--dry-run"])
        assert dry.exit_code == 2 and "is recorded estimated; a measured sweep needs its own --out" in dry.output
        assert "Traceback" not in dry.output


def test_run_estimate_checks_the_sequences():
    result = runner.invoke(app, ["run", *TINY, "--override", "max_seq_len=8", "--estimate"])
    assert result.exit_code == 2
    assert "max_seq_len=8" in result.output and "Traceback" not in result.output
