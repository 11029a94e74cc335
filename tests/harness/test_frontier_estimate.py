"""The capacity frontier estimated on fake tensors (``harness.capacity``, ``pf-bench frontier``): the
search lands exactly between two estimated peaks, a layout's search runs on the fake process group, the
answers of ``--fits`` agree with the search, and bad input is one line naming the option."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from harness.capacity import frontier_cells, parse_size, search_frontier
from harness.cli import app
from harness.estimate import estimate_cell
from harness.run.frontier import run_frontier
from harness.spec.cell import Cell, FrontierSearch, ModelSpec, Parallel
from harness.spec.load import expand, parse_spec

TINY = {"dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "vocab_size": 64}
MODEL = ModelSpec(name="llama3:debugmodel", overrides=TINY)
FIELDS = dict(n=2, microbatch=1, dtype="fp32", ac="none")
runner = CliRunner()


def _peak(total: int, system="prefixflow", offload=True, parallel=None) -> float:
    prefix = round(0.75 * total)
    cell = Cell(
        spec="t", model=MODEL, prefix_len=prefix, suffix_len=total - prefix, systems=(system,), offload=offload,
        parallel=parallel or Parallel(), device="cpu", warmup=0, repeats=1, **FIELDS,
    )  # fmt: skip
    (rec,) = estimate_cell(cell)
    assert rec["status"] == "ok", rec["error"]
    return rec["peak_mem_bytes"]


def test_the_estimated_search_stops_between_two_estimated_peaks(tmp_path):
    """A budget halfway between the estimated peaks at 192 and 256 tokens: the frontier is 192 exactly, and
    every probe's verdict is its peak against the budget."""
    low, high = _peak(192), _peak(256)
    assert low < high
    search = FrontierSearch(
        budget_bytes=int((low + high) / 2), mode="ratio", ratio=0.75, min_len=64, max_len=1024, resolution=64
    )
    (cell,) = frontier_cells(MODEL, search, ["prefixflow+offload"], **FIELDS)
    rows = estimate_cell(cell, tmp_path / "frontier")
    assert {r["frontier_len"] for r in rows} == {192}
    assert [r["searched_len"] for r in rows] == [64, 128, 256, 192]  # doubling, then one bisection
    for r in rows:
        assert r["mem_meter"] == "fake-live-bytes"
        assert r["fits"] == (r["peak_mem_bytes"] <= search.budget_bytes)
    assert next(r for r in rows if r["searched_len"] == 192)["peak_mem_bytes"] == low  # the same estimate


def test_a_frontier_block_in_a_spec_carries_its_layout_and_an_estimate_runs_it(tmp_path):
    spec = parse_spec(
        {
            "name": "fr", "device": "cpu", "axes": {"models": [MODEL.model_dump()], "lengths": [{"prefix": 8, "suffix": 8}], "n": [2]},
            "frontier": [{"budget_bytes": 2**30, "mode": "prefix", "prefix_len": 96, "min_len": 32, "max_len": 32,
                          "resolution": 16, "n": 2, "microbatch": 1, "parallel": {"tp": 2}, "variants": ["baseline"]}],
            "executor": {"kind": "estimate"},
        }
    )  # fmt: skip
    (cell,) = [c for c in expand(spec) if c.frontier is not None]
    assert cell.parallel.tp == 2 and cell.world_size == 2
    rows = search_frontier([cell.model_copy(update={"spec": "frontier"})], tmp_path)
    assert list(rows["status"]) == ["ok"] and list(rows["frontier_len"]) == [32]
    assert rows["peak_mem_bytes"].iloc[0] == _peak(128, "baseline", False, Parallel(tp=2))  # P=96, S=32
    assert (tmp_path / "frontier" / "_probes").is_dir()  # resumable: the probe is kept


def test_a_measured_search_on_several_ranks_is_refused_in_one_line(tmp_path):
    search = FrontierSearch(budget_bytes=2**30, mode="ratio", ratio=0.5, min_len=64, max_len=64, resolution=8)
    (cell,) = frontier_cells(MODEL, search, ["baseline"], Parallel(tp=2), **FIELDS)
    (rec,) = run_frontier(cell, tmp_path)
    assert rec["status"] == "refused" and "frontier.parallel" in rec["error"] and "estimate" in rec["error"]
    assert "\n" not in rec["error"]


def test_sizes_parse_as_gpu_memory_is_quoted():
    assert parse_size("96GiB") == parse_size("96G") == 96 * 2**30
    assert parse_size("80GB") == 80 * 10**9 and parse_size("512MiB") == 2**29 and parse_size(1024) == 1024
    for bad in ("0", "-1", "96 gibibytes", "", "1e9", "nan"):
        with pytest.raises(ValueError):
            parse_size(bad)


def _cli(tmp_path, *args):
    base = ["frontier", "--model", "llama3:debugmodel", *[f"--override={k}={v}" for k, v in TINY.items()]]
    base += ["--dtype", "fp32", "--ac", "none", "--out", str(tmp_path)]
    return runner.invoke(app, base + [str(a) for a in args])


def test_fits_answers_as_the_search_does(tmp_path):
    """The search finds PrefixFlow with offload a longer frontier than the baseline; ``--fits`` at that
    frontier fits, and one grid step above does not."""
    res = _cli(tmp_path, "--budget", "16MiB", "--min-len", "256", "--max-len", "2048", "--resolution", "256",
               "--json")  # fmt: skip
    assert res.exit_code == 0, res.output
    front = {r["variant"]: r["max_total"] for r in json.loads(res.stdout.splitlines()[-1])["frontier"]}
    assert set(front) == {"baseline", "prefixflow+offload"} and 0 < front["baseline"] < front["prefixflow+offload"]
    variant, best = "prefixflow+offload", front["prefixflow+offload"]
    for length, expected in ((best, True), (best + 256, False)):
        res = _cli(tmp_path, "--budget", "16MiB", "--fits", length, "--variants", variant, "--json")
        assert res.exit_code == 0, res.output
        (row,) = json.loads(res.stdout.splitlines()[-1])["frontier"]
        assert row["fits"] is expected, (variant, length)


@pytest.mark.parametrize(("args", "named"), [
    (["--budget", "lots"], "--budget"),
    (["--budget", "0"], "--budget"),
    (["--budget", "1GiB", "--model", "llama3:nope"], "--model"),
    (["--budget", "1GiB", "--ratio", "1.5"], "--ratio"),
    (["--budget", "1GiB", "--ratio", "0.5", "--prefix-len", "64"], "--prefix-len"),
    (["--budget", "1GiB", "--min-len", "512", "--max-len", "256"], "--max-len"),
    (["--budget", "1GiB", "--variants", "nosuch"], "--variants"),
    (["--budget", "1GiB", "--variants", "prefixflow+"], "--variants"),
    (["--budget", "1GiB", "--max-len", "300000"], "more than the model's max_seq_len=131072"),
])  # fmt: skip
def test_bad_input_is_one_line_naming_the_option(tmp_path, args, named):
    res = _cli(tmp_path, *args)
    assert res.exit_code == 2, res.output
    assert named in res.output and "Traceback" not in res.output
    assert not (tmp_path / "frontier").exists()  # refused before any state changed
