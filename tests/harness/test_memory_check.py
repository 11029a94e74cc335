"""Issue 26, defect 2: `pf-bench run`, sweep cells and `pf-bench rl` check memory before they allocate.

The model is built on the meta device, a floor on weights + grads + optimizer + activations is compared with
what this process may take (MemAvailable, the RLIMIT_AS headroom, the cgroup's memory.max headroom,
$PF_MEMORY_LIMIT), and what cannot fit is refused in one line (a sweep cell: recorded ``refused``)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest
from support import REPO
from typer.testing import CliRunner

from harness.cli import app
from harness.records import read_records
from harness.run.memory import cell_need, meta_shape, preflight_cell
from harness.spec.load import expand, load_spec
from prefixflow.memory import limit as ml

runner = CliRunner()
SMALL = ["--prefix-len", "8", "--suffix-len", "4", "--n", "2", "--warmup", "0", "--repeats", "1"]


def invoke(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env=env, catch_exceptions=False)


def one_line_error(res, *needles: str) -> str:
    assert res.exit_code == 2, res.output
    out = " ".join(res.output.split())
    assert "Traceback" not in res.output and out.startswith("error:"), res.output
    for n in needles:
        assert n in out, out
    return out


def test_limit_is_the_smallest_source(monkeypatch, tmp_path):
    """MemAvailable, RLIMIT_AS headroom, the cgroup (v2 file layout, an ancestor's limit counts) and the
    configured budget: the smallest wins, named."""
    cg = tmp_path / "cg"
    (cg / "job" / "step").mkdir(parents=True)
    (cg / "job" / "memory.max").write_text("3000000000\n")
    (cg / "job" / "memory.current").write_text("1000000000\n")
    (cg / "job" / "step" / "memory.max").write_text("max\n")
    (cg / "job" / "step" / "memory.current").write_text("5\n")
    member = tmp_path / "cgroup"
    member.write_text("0::/job/step\n")
    assert ml._cgroup_headroom(cg, member) == 2_000_000_000
    monkeypatch.setattr(ml, "_mem_available", lambda: 8 * 2**30)
    monkeypatch.setattr(ml, "_address_space_headroom", lambda: None)
    monkeypatch.setattr(ml, "_cgroup_headroom", lambda: 2_000_000_000)
    monkeypatch.delenv(ml.ENV, raising=False)
    assert ml.memory_limit() == ml.Limit(2_000_000_000, "the cgroup's memory.max headroom")
    monkeypatch.setenv(ml.ENV, "1G")
    assert ml.memory_limit() == ml.Limit(2**30, f"the configured budget (${ml.ENV})")
    monkeypatch.setenv(ml.ENV, "lots")
    with pytest.raises(ValueError, match=r"PF_MEMORY_LIMIT='lots' is not a size"):
        ml.memory_limit()
    assert ml.parse_bytes("1.5GiB") == 3 * 2**29 and ml.parse_bytes("123") == 123


def test_run_refuses_a_model_that_cannot_fit_before_building_it(monkeypatch):
    """`--model llama3:8B` (8B parameters, two fp32 copies: ~120 GiB) and `--override dim=16384` under a 2 GiB
    budget: one line naming the need, the limit and the fix; nothing built."""
    import harness.run.setup as setup

    def built(*a, **k):
        raise AssertionError("a model was built before the memory check")

    monkeypatch.setattr(setup, "build_cell_model", built)
    env = {ml.ENV: "2G"}
    out = one_line_error(invoke("run", "--model", "llama3:8B", *SMALL, env=env), "8030M parameters")
    assert "more than the 2.0 GiB" in out and "PF_MEMORY_LIMIT" in out and "--override" in out
    one_line_error(invoke("run", "--model", "llama3:debugmodel", "--override", "dim=16384", *SMALL, env=env))


def test_run_refuses_hf_models_and_huge_layer_counts(monkeypatch):
    """`hf:llama3-8b` and `hf:llama-tiny --override num_hidden_layers=100000` (counted from two small meta
    builds, not 100000 layers) are refused in one line."""
    env = {ml.ENV: "2G"}
    one_line_error(invoke("run", "--model", "hf:llama3-8b", *SMALL, env=env), "8030M parameters")
    res = invoke("run", "--model", "hf:llama-tiny", "--override", "num_hidden_layers=100000", *SMALL, env=env)
    one_line_error(res, "num_hidden_layers=2")
    from prefixflow.model.models import count_parameters

    many = {"dim": 32, "n_heads": 2, "vocab_size": 128, "n_layers": 100}
    assert meta_shape("llama3:debugmodel", many).n_params == count_parameters("llama3:debugmodel", many)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's")
def test_run_under_ulimit_v_is_refused_not_oom():
    """The attack as filed: `ulimit -v 8000000` and `--model llama3:8B` used to allocate, fail and write an
    oom record; now one line naming the RLIMIT_AS headroom, exit 2."""
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    limit = 8_000_000 * 1024 if hard == resource.RLIM_INFINITY else min(8_000_000 * 1024, hard)

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }
    env.pop(ml.ENV, None)
    proc = subprocess.run(
        [sys.executable, "-m", "harness.cli", "run", "--model", "llama3:8B", *SMALL],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=cap,
    )
    assert proc.returncode == 2, proc.stderr
    assert "RLIMIT_AS" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


SPEC = """
name: refused
systems: [baseline, prefixflow]
warmup: 0
repeats: 1
axes:
  models:
    - {name: "llama3:debugmodel", overrides: {dim: 32, n_layers: 2, n_heads: 2, vocab_size: 128}}
    - {name: "llama3:debugmodel", overrides: {dim: 16384, n_layers: 2, n_heads: 16, vocab_size: 128}}
  prefix_ratio: [0.5]
  total_len: [16]
  n: [2]
"""


def test_sweep_records_a_cell_that_cannot_fit_as_refused(tmp_path):
    """The small cell runs; the dim=16384 cell is recorded `refused` with the one-line reason, and status
    counts it as such."""
    spec = tmp_path / "refused.yaml"
    spec.write_text(SPEC)
    out = tmp_path / "out"
    env = {ml.ENV: "2G"}
    res = invoke("sweep", spec, "--out", out, "--executor", "debug", env=env)
    assert res.exit_code == 1, res.output
    statuses = {}
    for path in (out / "refused").glob("*.parquet"):
        df = read_records(path)
        statuses[df["model_overrides"].iloc[0]] = (set(df["status"]), df["error"].iloc[0])
    assert len(statuses) == 2
    big = next(v for k, v in statuses.items() if "16384" in k)
    small = next(v for k, v in statuses.items() if "16384" not in k)
    assert small[0] == {"ok"} and big[0] == {"refused"}
    assert "needs at least" in big[1] and "\n" not in big[1]
    res = invoke("status", out)
    assert res.exit_code == 0 and "refused" in res.output, res.output


def test_no_committed_spec_at_its_default_scale_is_refused():
    """Every measurement cell of every committed sweep spec at its default preset needs under 4 GiB (the
    machines they were measured on), and passes the check under a 4 GiB budget."""
    for path in sorted((REPO / "experiments").glob("*.yaml")):
        if path.name == "claim2.yaml":  # the RL spec: tests/harness/rl/test_rl_preflight.py
            continue
        spec = load_spec(path)
        if spec.executor.kind == "estimate":  # fake tensors allocate nothing (paper_scale.yaml: an 8B model)
            continue
        for cell in expand(spec):
            if cell.frontier is None and cell.alignment is None:
                assert cell_need(cell, meta_shape(cell.model.name, cell.model.overrides)) < 4 * 2**30, cell
                preflight_cell(cell, budget=4 * 2**30)


def test_alignment_uses_the_shared_limit(monkeypatch):
    """`align` keeps its own count (6 tensors per parameter and copy) against the same limit."""
    from prefixflow.checks import alignment

    monkeypatch.setattr(alignment, "memory_limit", lambda: ml.Limit(2**20, "test"))
    with pytest.raises(ml.MemoryRefusal, match="more than the 0.0 GiB available"):
        alignment.run_alignment("llama3:debugmodel")


def test_an_alignment_cell_that_cannot_fit_is_recorded_refused(monkeypatch):
    from harness.run.alignment import run_alignment_cell
    from harness.spec.cell import AlignmentSettings, Cell, ModelSpec

    monkeypatch.setenv(ml.ENV, "1M")
    cell = Cell(
        spec="a", model=ModelSpec(name="llama3:debugmodel"), prefix_len=8, suffix_len=4, n=2,
        alignment=AlignmentSettings(steps=1), device="cpu",
    )  # fmt: skip
    records = run_alignment_cell(cell)
    assert {r["status"] for r in records} == {"refused"}, records[0]["error"]
    assert "Traceback" not in records[0]["error"] and "more than the 0.0 GiB available" in records[0]["error"]
