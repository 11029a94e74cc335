"""Capacity-frontier search: bracketing, every probe recorded, OOM handling, resumability, spec/sweep."""

from __future__ import annotations

import pandas as pd
import pytest

from harness.execute.executors import DebugExecutor
from harness.records import cell_status, collect
from harness.run.columns import base_record
from harness.run.frontier import bracketed_search, run_frontier
from harness.spec.cell import Cell, FrontierSearch, ModelSpec
from harness.spec.load import SpecError, expand, parse_spec
from harness.sweep import run_sweep

MIB = 2**20
TINY = ModelSpec(
    name="llama3:debugmodel", overrides={"dim": 32, "n_layers": 1, "n_heads": 2, "vocab_size": 64}
)


def _search(**over) -> FrontierSearch:
    base = dict(budget_bytes=100 * MIB, mode="ratio", ratio=0.75, min_len=64, max_len=4096, resolution=32)
    return FrontierSearch(**{**base, **over})


def _cell(system="baseline", offload=False, **over) -> Cell:
    return Cell(
        spec="t", model=TINY, prefix_len=48, suffix_len=16, n=4, systems=(system,), offload=offload,
        warmup=0, repeats=1, device="cpu", frontier=_search(**over),
    )  # fmt: skip


class FakeMemory:
    """A linear memory model per system: peak = fixed + per_token * (prefix + suffix); over ``oom_from``
    tokens the step raises the way a CUDA allocator would (status oom from the runner)."""

    def __init__(self, per_token: float, fixed: float = 10 * MIB, oom_from: int | None = None):
        self.per_token, self.fixed, self.oom_from, self.calls = per_token, fixed, oom_from, []

    def __call__(self, cell: Cell) -> list[dict]:
        total = cell.prefix_len + cell.suffix_len
        self.calls.append((cell.prefix_len, cell.suffix_len))
        rec = {**base_record(cell, "cpu"), "system": cell.systems[0], "offload": cell.offload}
        if self.oom_from is not None and total >= self.oom_from:
            return [{**rec, "status": "oom", "error": "CUDA out of memory (fake)"}]
        peak = self.fixed + self.per_token * total
        return [{**rec, "status": "ok", "error": None, "peak_mem_bytes": peak, "mem_meter": "fake"}]


@pytest.mark.parametrize(("min_len", "max_len", "res", "limit"), [
    (64, 4096, 32, 1000), (64, 4096, 1, 777), (100, 5000, 50, 4999), (64, 4096, 32, 63), (64, 4096, 32, 5000),
    (64, 4096, 32, 64), (64, 64, 8, 64),
])  # fmt: skip
def test_bracketing_finds_the_boundary(min_len, max_len, res, limit):
    probed = []

    def fits(n):
        probed.append(n)
        return n <= limit

    best = bracketed_search(min_len, max_len, res, fits)
    if limit < min_len:
        assert best == 0 and probed == [min_len]
        return
    grid = [n for n in range(min_len, max_len + 1, res)] + [max_len]
    assert best == max(n for n in grid if n <= limit)
    assert all(min_len <= n <= max_len for n in probed) and len(set(probed)) == len(probed)
    assert len(probed) <= 2 * (max_len // min_len).bit_length() + 2 * (max_len // res).bit_length()


def test_a_failed_probe_ends_the_search_with_the_best_so_far():
    answers = {64: True, 128: True, 256: None}
    assert bracketed_search(64, 4096, 32, lambda n: answers[n]) == 128
    with pytest.raises(ValueError):
        bracketed_search(64, 32, 8, lambda n: True)


def test_probe_split_modes():
    assert _search().split(1024) == (768, 256)
    assert _search(mode="prefix", ratio=None, prefix_len=500).split(300) == (500, 300)
    assert _search(ratio=0.99).split(8) == (7, 1)  # never an empty suffix


def test_every_probe_is_recorded_over_budget_is_oom(tmp_path):
    fake = FakeMemory(per_token=0.1 * MIB)  # 100 MiB budget: fits up to 900 tokens
    rows = run_frontier(_cell(), tmp_path, probe=fake)
    df = pd.DataFrame(rows)
    assert len(rows) == len(fake.calls) >= 5
    assert list(df["probe"]) == list(range(len(rows)))
    assert (df["budget_bytes"] == 100 * MIB).all() and df["cell_id"].is_unique
    assert set(df["frontier_len"]) == {896}  # 64 + 26 * 32, the last grid point <= 900
    over = df[df["peak_mem_bytes"] > 100 * MIB]
    assert not over.empty and (over["status"] == "oom").all() and not over["fits"].any()
    assert over["error"].str.contains("> budget 100.00 MiB").all()
    assert df.loc[df["fits"], "searched_len"].max() == 896
    assert (df["prefix_len"] == (df["searched_len"] * 0.75).round()).all()
    assert cell_status(df) == "ok"  # a finished search is ok although it has oom probes


def test_oom_is_caught_and_the_search_goes_on(tmp_path):
    fake = FakeMemory(per_token=0.0, oom_from=1000)  # the "device" runs out at 1000 tokens
    rows = run_frontier(_cell(), tmp_path, probe=fake)
    df = pd.DataFrame(rows)
    first_oom = df.index[df["status"] == "oom"][0]
    assert first_oom < len(df) - 1  # the search went on after the out-of-memory probe
    assert df.loc[df["status"] == "oom", "error"].str.contains("out of memory").all()
    assert set(df["frontier_len"]) == {992}


def test_a_killed_search_resumes_without_rerunning_its_probes(tmp_path):
    fake = FakeMemory(per_token=0.1 * MIB)
    first = run_frontier(_cell(), tmp_path, probe=fake)

    class Killed(Exception):
        pass

    def dies_after(k):
        inner = FakeMemory(per_token=0.1 * MIB)

        def probe(cell):
            if len(inner.calls) == k:
                raise Killed
            return inner(cell)

        return probe, inner

    fresh = tmp_path / "again"
    probe, inner = dies_after(3)
    with pytest.raises(Killed):
        run_frontier(_cell(), fresh, probe=probe)
    assert len(inner.calls) == 3
    again = FakeMemory(per_token=0.1 * MIB)
    rows = run_frontier(_cell(), fresh, probe=again)
    assert len(again.calls) == len(first) - 3  # the three finished probes were read back, not rerun
    assert [r["searched_len"] for r in rows] == [r["searched_len"] for r in first]
    assert [r["fits"] for r in rows] == [r["fits"] for r in first]


def test_cpu_search_without_budget_is_an_error_record(tmp_path):
    rows = run_frontier(_cell(budget_bytes=None), tmp_path, probe=FakeMemory(0.1))
    assert rows[0]["status"] == "error" and "budget_bytes" in rows[0]["error"]


def _spec(**frontier):
    block = {"budget_bytes": 50 * MIB, "mode": "ratio", "ratio": 0.75, "min_len": 16, "max_len": 128,
             "resolution": 16, "n": 2, **frontier}  # fmt: skip
    return {
        "name": "f",
        "device": "cpu",
        "axes": {"models": [TINY.model_dump()], "n": [2], "lengths": [{"prefix": 12, "suffix": 4}]},
        "extra_axes": [
            {"models": [TINY.model_dump()], "n": [2], "lengths": [{"prefix": 8, "suffix": 8}],
             "microbatch": [1, 2], "systems": ["prefixflow"], "repeats": 1},
        ],
        "frontier": [block],
    }  # fmt: skip


def test_spec_expands_blocks_and_one_search_per_variant():
    cells = expand(parse_spec(_spec()))
    assert [c.frontier is not None for c in cells] == [True] * 3 + [False] * 3  # searches start first
    plain = [c for c in cells if c.frontier is None]
    searches = [c for c in cells if c.frontier is not None]
    assert len(plain) == 3 and {c.systems for c in plain} == {("baseline", "prefixflow"), ("prefixflow",)}
    assert {c.repeats for c in plain if c.systems == ("prefixflow",)} == {1}
    assert [(c.systems, c.offload) for c in searches] == [
        (("baseline",), False), (("prefixflow",), False), (("prefixflow",), True),
    ]  # fmt: skip
    assert (searches[0].prefix_len, searches[0].suffix_len) == (12, 4)
    assert len({c.cell_id for c in cells}) == len(cells)
    with pytest.raises(SpecError, match="mode 'prefix' needs 'prefix_len'"):
        parse_spec(_spec(mode="prefix"))
    with pytest.raises(SpecError, match="variant"):
        parse_spec(_spec(variants=["base line"]))


def test_sweep_runs_real_probes_and_is_resumable(tmp_path):
    """Real one-step probes of a one-layer model; a second sweep runs nothing."""
    spec = parse_spec({**_spec(variants=["baseline", "prefixflow+offload"]), "extra_axes": []})
    p = run_sweep(spec, tmp_path, DebugExecutor())
    assert len(p.todo) == 3 and set(p.done.values()) == {"ok"}
    df = collect(tmp_path)
    probes = df[df["budget_bytes"].notna()]
    assert set(probes["system"]) == {"baseline", "prefixflow"} and probes["peak_mem_bytes"].gt(0).all()
    off = probes[probes["offload"].astype(bool)]
    assert (off["offload_tier"] == "cpu-file").all() and off["offloaded_bytes"].max() > 0
    assert off.sort_values("searched_len")["offloaded_bytes"].is_monotonic_increasing  # grows with the prefix
    assert probes.groupby("search_id")["frontier_len"].nunique().eq(1).all()
    assert run_sweep(spec, tmp_path, DebugExecutor()).todo == []


def test_frontier_table_reads_one_search_at_a_time(tmp_path):
    from harness.figures.fig10 import frontier_table

    ratio = run_frontier(_cell(), tmp_path, probe=FakeMemory(per_token=0.1 * MIB))
    prefix = run_frontier(
        _cell(mode="prefix", ratio=None, prefix_len=400), tmp_path, probe=FakeMemory(per_token=0.1 * MIB)
    )
    df = pd.DataFrame(ratio + prefix)
    probes, front, _ = frontier_table(df)
    assert set(probes["search"]) == {"ratio 0.75"} and front["max_total"].tolist() == [896]
    probes, front, _ = frontier_table(df, search="prefix 400")
    assert len(probes) == len(prefix) and front["max_total"].tolist() == [400 + 480]  # suffix 480 fits


def test_status_counts_a_search_as_one_cell(tmp_path):
    from harness.records import summarize, write_records

    rows = run_frontier(_cell(), tmp_path, probe=FakeMemory(per_token=0.1 * MIB))
    write_records(tmp_path / f"{_cell().cell_id}.parquet", rows)  # a record is named by its cell
    s = summarize(collect(tmp_path)).iloc[0]
    assert s["cells"] == 1 and s["ok"] == 1 and s["oom"] == 0  # over-budget probes are how it searches
    assert s["rows"] == len(rows) and any(r["status"] == "oom" for r in rows)


def test_an_error_probe_stops_the_search_and_is_retried_on_resume(tmp_path):
    calls = []

    def broken(cell):
        calls.append(cell.prefix_len + cell.suffix_len)
        rec = {**base_record(cell, "cpu"), "system": cell.systems[0]}
        if len(calls) == 3:
            return [{**rec, "status": "error", "error": "Traceback: boom"}]
        return FakeMemory(per_token=0.1 * MIB)(cell)

    rows = run_frontier(_cell(), tmp_path, probe=broken)
    assert [r["status"] for r in rows] == ["ok", "ok", "error"] and rows[-1]["frontier_len"] == 128
    again = FakeMemory(per_token=0.1 * MIB)
    rows = run_frontier(_cell(), tmp_path, probe=again)
    assert again.calls[0] == (192, 64)  # the failed probe (256 tokens) runs again; the two before do not
    assert set(r["frontier_len"] for r in rows) == {896}
