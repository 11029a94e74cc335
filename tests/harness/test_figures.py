"""harness.figures: every figure renders from synthetic records, absent records skip, pairing is right."""

from __future__ import annotations

import json
import logging

import numpy as np
import pandas as pd
import pytest

from harness.figures import FIGURES, render_all, render_tables
from harness.figures.common import pair_speedups
from harness.figures.fig10 import fixed_total_peaks, frontier_table
from harness.figures.fig11 import budget_points
from harness.figures.tables import alignment_frame, speedup_frame, to_latex, to_markdown

MIB = 1024**2
GIB = 1024**3
BASE = {
    "spec": "synthetic", "model": "llama3:debugmodel", "dtype": "fp32", "device": "cpu", "layout": "padded",
    "tp": 1, "cp": 1, "pp": 1, "dp": 1, "ep": 1, "status": "ok", "error": None, "repeats": 3,
    "mem_meter": "cpu-live-bytes", "compile": False, "offload": False, "ac": "selective", "microbatch": 1,
}  # fmt: skip


def _rec(system, P, S, n, **kw):
    r = {**BASE, "system": system, "prefix_len": P, "suffix_len": S, "n": n, "prefix_ratio": P / (P + S)}
    r["cell_id"] = f"{P}-{S}-{n}-{kw.get('compile', False)}-{kw.get('microbatch', 1)}-{kw.get('ac', 'sel')}"
    r.update(kw)
    return r


def speed_records():
    rows = []
    for compiled in (False, True):
        for P in (256, 768, 1280):
            S = 1536 - P
            for n in (2, 4, 8, 16):
                base = n * (P + S) * 1e-4
                pf = (P + n * S) * 1e-4 + 0.01
                ideal = n * (P + S) / (P + n * S)
                rows.append(
                    _rec(
                        "baseline",
                        P,
                        S,
                        n,
                        spec="claim3",
                        compile=compiled,
                        step_time_s=base,
                        peak_mem_bytes=200 * MIB,
                        peak_mem_phase_b_bytes=200 * MIB,
                    )
                )
                rows.append(
                    _rec(
                        "prefixflow",
                        P,
                        S,
                        n,
                        spec="claim3",
                        compile=compiled,
                        step_time_s=pf,
                        ideal_speedup=ideal,
                        phase_a_s=0.1,
                        phase_b_s=0.2,
                        phase_c_s=0.1,
                        peak_mem_bytes=150 * MIB,
                        peak_mem_phase_b_bytes=120 * MIB,
                    )
                )
    return rows


def memory_records():
    rows = []
    for P in (256, 768, 1280):
        S = 1536 - P
        rows.append(_rec("baseline", P, S, 8, step_time_s=1.0, peak_mem_phase_b_bytes=1000 * MIB))
        rows.append(_rec("prefixflow", P, S, 8, step_time_s=0.5, peak_mem_phase_b_bytes=(1000 - P / 2) * MIB))
        rows.append(
            _rec(
                "prefixflow",
                P,
                S,
                8,
                offload=True,
                step_time_s=0.55,
                peak_mem_phase_b_bytes=(1000 - P * 0.6) * MIB,
            )
        )
    for b in (1, 2, 4, 8):
        for ac in ("selective", "full-save"):
            for off in (False, True):
                oom = b == 8 and not off
                rows.append(
                    _rec(
                        "prefixflow",
                        1280,
                        256,
                        16,
                        microbatch=b,
                        ac=ac,
                        offload=off,
                        status="oom" if oom else "ok",
                        step_time_s=None if oom else 2.0 / b,
                        phase_b_s=None if oom else 1.5 / b + (0 if ac == "full-save" else 0.2),
                        peak_mem_phase_b_bytes=None if oom else (300 + 50 * b - 40 * off) * MIB,
                    )
                )
    return rows


def frontier_records(budget=512 * MIB):
    rows = []
    for system, off, per_tok in (
        ("baseline", False, 0.4),
        ("prefixflow", False, 0.3),
        ("prefixflow", True, 0.2),
    ):
        for i, total in enumerate((1024, 1536, 2048, 2560, 3072)):
            P = total * 5 // 6
            peak = per_tok * total * MIB
            rows.append(
                _rec(
                    system,
                    P,
                    total - P,
                    8,
                    offload=off,
                    probe=i,
                    budget_bytes=budget,
                    status="ok" if peak <= budget else "oom",
                    peak_mem_bytes=peak,
                    step_time_s=1.0,
                )
            )
    return rows


def all_records():
    return pd.DataFrame(speed_records() + memory_records() + frontier_records())


def test_every_figure_renders_a_png(tmp_path):
    df = all_records()
    paths = render_all(df, tmp_path)
    names = sorted(p.name for p in paths)
    assert names == sorted([
        "fig9a_speedup_eager.png", "fig9b_speedup_compiled.png", "fig10a_phase_b_peak.png",
        "fig10b_capacity_frontier.png", "fig11_suffix_budget.png", "smoke_overview.png",
    ])  # fmt: skip
    for p in paths:
        assert p.stat().st_size > 5000
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_records_are_skipped_with_a_reason(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="harness.figures"):
        only_eager = pd.DataFrame([r for r in speed_records() if not r["compile"]])
        only_eager = only_eager.drop(columns=["peak_mem_phase_b_bytes"])
        paths = render_all(only_eager, tmp_path)
    names = {p.name for p in paths}
    assert names == {"fig9a_speedup_eager.png", "smoke_overview.png"}
    text = caplog.text
    for name in ("fig9b", "fig10a", "fig10b", "fig11"):
        assert f"skip {name}" in text
    assert render_all(pd.DataFrame(), tmp_path / "empty") == []
    assert render_tables(pd.DataFrame(), tmp_path / "empty") == []
    with pytest.raises(ValueError):
        render_all(only_eager, tmp_path, only=["fig99"])


def test_speedup_pairing_matches_config_and_takes_medians():
    rows = [
        _rec("baseline", 768, 768, 4, step_time_s=2.0),
        _rec("baseline", 768, 768, 4, step_time_s=4.0, seed=1),  # repeat -> median 3.0
        _rec("prefixflow", 768, 768, 4, step_time_s=1.0, ideal_speedup=3.5),
        _rec("prefixflow", 768, 768, 4, step_time_s=1.5, offload=True),  # pairs with the same baseline
        _rec("baseline", 768, 768, 8, step_time_s=10.0),
        _rec("prefixflow", 768, 768, 8, step_time_s=2.0),
        _rec("prefixflow", 768, 768, 8, step_time_s=0.1, compile=True),  # no compiled baseline: unpaired
        _rec("prefixflow", 768, 768, 8, step_time_s=0.1, dtype="bf16"),  # other dtype: unpaired
        _rec("baseline", 768, 768, 16, step_time_s=1.0, status="error"),  # failed: ignored
        _rec("prefixflow", 768, 768, 16, step_time_s=0.5),
    ]
    sp = pair_speedups(pd.DataFrame(rows)).sort_values(["n", "offload"]).reset_index(drop=True)
    assert list(sp["n"]) == [4, 4, 8]
    assert list(sp["offload"]) == [False, True, False]
    assert list(sp["speedup"]) == pytest.approx([3.0, 2.0, 5.0])
    assert sp.loc[0, "ideal_speedup"] == 3.5
    assert list(sp["compile"]) == [False, False, False] and set(sp["dtype"]) == {"fp32"}


def test_pairing_handles_missing_config_values():
    rows = [
        _rec("baseline", 64, 64, 2, step_time_s=1.0, microbatch=None, ac=None),
        _rec("prefixflow", 64, 64, 2, step_time_s=0.25, microbatch=None, ac=None),
    ]
    sp = pair_speedups(pd.DataFrame(rows))
    assert list(sp["speedup"]) == [4.0]


def test_memory_figures_select_one_setting():
    df = all_records()
    peaks = fixed_total_peaks(df)
    assert len(peaks) == 9 and set(peaks["variant"]) == {"baseline", "prefixflow", "prefixflow+offload"}
    assert set(peaks.loc[peaks["variant"] == "baseline", "peak_mem_phase_b_bytes"]) == {1000 * MIB}
    off = peaks[peaks["variant"] == "prefixflow+offload"].set_index("prefix_len")["peak_mem_phase_b_bytes"]
    assert off[1280] == pytest.approx((1000 - 1280 * 0.6) * MIB)
    pts = budget_points(df)
    assert len(pts) == 16 and set(pts["spec"]) == {"synthetic"} and set(pts["n"]) == {16}
    assert (pts["status"] == "oom").sum() == 2


def test_frontier_table_and_budget_reread():
    df = pd.DataFrame(frontier_records(budget=512 * MIB))
    probes, front, budget = frontier_table(df)
    assert budget == 512 * MIB and len(probes) == 15
    f = front.set_index("variant")["max_total"]
    # 0.4 MiB/token -> 1280 fits up to 1024; 0.3 -> 1536; 0.2 -> 2560
    assert f.to_dict() == {"baseline": 1024, "prefixflow": 1536, "prefixflow+offload": 2560}
    assert front.set_index("variant").loc["prefixflow+offload", "vs_baseline"] == pytest.approx(2.5)
    _, tighter, _ = frontier_table(df, budget=400 * MIB)
    assert tighter.set_index("variant")["max_total"].to_dict()["prefixflow+offload"] == 1536


def test_tables_markdown_latex_and_alignment(tmp_path):
    df = pd.DataFrame(speed_records())
    table = speedup_frame(df)
    assert len(table) == 24 and {"speedup", "ideal", "of ideal", "peak ÷ base"} <= set(table.columns)
    row = table[(table["P"] == 1280) & (table["N"] == 16) & ~table["compiled"]].iloc[0]
    assert row["speedup"] == pytest.approx(16 * 1536e-4 / (1280e-4 + 16 * 256e-4 + 0.01))
    align = pd.DataFrame([
        {"model": "llama3", "step": s, "quantity": q, "max_abs_diff": 1e-7 * s, "pass": not (s == 20 and q == "W")}
        for s in (1, 10, 20) for q in ("L", "G", "W")
    ])  # fmt: skip
    csv = tmp_path / "alignment.csv"
    align.to_csv(csv, index=False)
    frame = alignment_frame(align)  # older rows: no run, no normwise columns
    assert list(frame.columns) == ["model", "run", "step", "max|dG|", "max|dL|", "max|dW|", "result"]
    assert list(frame["result"]) == ["pass", "pass", "FAIL"]
    controls = pd.DataFrame([
        {"model": "llama3", "run": run, "step": 1, "quantity": q, "max_abs_diff": 1e-3,
         "norm_rel_diff": rel if q == "G" else 0.5, "norm_tol": 0.014 if q == "G" else float("nan"),
         "margin": rel / 0.004 if run != "prefixflow" else float("nan"), "passed": run == "prefixflow"}
        for run, rel in (("gkv_x0.9", 0.09), ("prefixflow", 0.004)) for q in ("G", "L", "W")
    ])  # fmt: skip
    frame = alignment_frame(controls)
    assert list(frame["run"]) == ["prefixflow", "gkv_x0.9"]  # the correct run first, then the controls
    assert list(frame["result"]) == ["pass", "FAIL (x22.5)"]
    assert list(frame["G norm"]) == [0.004, 0.09] and list(frame["G bound"]) == [0.014, 0.014]
    both = pd.concat([align.assign(parallel="single"), controls.assign(parallel="cp2")], ignore_index=True)
    frame = alignment_frame(both)  # align --out rows ("pass") beside alignment cells' rows ("passed")
    assert sorted(frame["result"]) == sorted(["pass", "pass", "FAIL", "pass", "FAIL (x22.5)"])
    paths = render_tables(df, tmp_path / "out", alignment=csv)
    assert sorted(p.name for p in paths) == [
        "speedup.md",
        "speedup.tex",
        "table3_alignment.md",
        "table3_alignment.tex",
    ]
    md = (tmp_path / "out" / "table3_alignment.md").read_text()
    assert "| model | run | step |" in md and "FAIL" in md
    tex = (tmp_path / "out" / "speedup.tex").read_text()
    assert r"\toprule" in tex and r"\end{tabular}" in tex and "llama3:debugmodel" in tex
    assert to_markdown(pd.DataFrame({"a_b": [1.0]})).startswith("| a_b |")
    assert r"a\_b" in to_latex(pd.DataFrame({"a_b": [1.0]}), "cap", "tab:x")


def test_registry_is_complete():
    assert set(FIGURES) == {
        "fig6a", "fig6b", "fig6_sim", "fig7", "fig8a", "fig8b", "claim2_summary", "fig9a", "fig9a_concat",
        "fig9a_split", "fig9b", "fig10a", "fig10b", "fig11", "smoke", "trees_speedup", "trees_time_memory",
        "multimodal", "fig7_verl", "fig8a_verl", "fig9a_paper", "fig10a_paper", "fig10b_paper", "fig11_paper",
    }  # fmt: skip


def test_mixed_revisions_are_flagged_in_figures_and_tables(tmp_path, caplog):
    from harness.figures.common import revision_warning

    recs = speed_records()
    one = pd.DataFrame([dict(r, git_rev="aaa111") for r in recs])
    assert revision_warning(one, "x") is None
    assert "uncommitted" in revision_warning(pd.DataFrame({"git_rev": ["aaa111-dirty"]}), "x")
    mixed = pd.DataFrame([dict(r, git_rev="aaa111" if r["n"] < 8 else "bbb222") for r in recs])
    with caplog.at_level(logging.WARNING, logger="harness.figures"):
        render_tables(mixed, tmp_path)
        render_all(mixed, tmp_path, only=["fig9a"])
    md = (tmp_path / "speedup.md").read_text()
    assert "WARNING" in md and "aaa111" in md and "bbb222" in md
    assert "Figure 9a: records from 2 git revisions" in caplog.text
    render_tables(one, tmp_path / "one")
    assert "WARNING" not in (tmp_path / "one" / "speedup.md").read_text()


def test_speedup_table_compares_memory_on_the_same_scope():
    rows = [
        _rec("baseline", 768, 768, 4, step_time_s=2.0, peak_mem_bytes=400 * MIB, peak_mem_phase_b_bytes=400 * MIB),
        _rec("prefixflow", 768, 768, 4, step_time_s=1.0, peak_mem_bytes=200 * MIB,
             peak_mem_phase_b_bytes=50 * MIB, attention="split"),
        _rec("prefix_grouper", 768, 768, 4, step_time_s=1.5, peak_mem_bytes=300 * MIB,
             peak_mem_phase_b_bytes=300 * MIB),
    ]  # fmt: skip
    table = speedup_frame(pd.DataFrame(rows)).set_index("system")
    assert (
        table.loc["prefixflow", "peak ÷ base"] == 0.5 and table.loc["prefix_grouper", "peak ÷ base"] == 0.75
    )
    assert table.loc["prefixflow", "B peak MiB"] == 50 and pd.isna(table.loc["prefix_grouper", "B peak MiB"])
    assert table.loc["prefixflow", "attention"] == "split"


def test_flag_reads_bools_tiers_and_missing_values():
    from harness.figures.common import flag

    df = pd.DataFrame({"offload": [True, False, None, float("nan"), "mmap", "none", 1, 0]})
    assert list(flag(df, "offload")) == [True, False, False, False, True, False, True, False]
    assert not flag(df, "absent").any()


def test_figure9_with_every_microbatch_missing(tmp_path):
    """Records of 'all responses in one microbatch' carry microbatch=None; pandas 3 keeps it missing."""
    df = pd.DataFrame(speed_records())
    df["microbatch"] = pd.array([None] * len(df), dtype="Int64")
    paths = render_all(df, tmp_path, only=["fig9a"])
    assert [p.name for p in paths] == ["fig9a_speedup_eager.png"] and paths[0].stat().st_size > 0


def test_figure9_split_variant_and_claim3_preference(tmp_path):
    recs = speed_records()
    split = [dict(r, system="prefixflow_split") for r in recs if r["system"] == "prefixflow"]
    other_spec = [dict(r, spec="claim4", step_time_s=r["step_time_s"] * 3) for r in recs]
    df = pd.DataFrame(recs + split + other_spec)
    paths = render_all(df, tmp_path, only=["fig9a", "fig9a_split"])
    assert sorted(p.name for p in paths) == [
        "fig9a_speedup_eager.png",
        "fig9a_speedup_eager_prefixflow_split.png",
    ]
    from harness.figures.fig9 import _speedups

    sp = _speedups(df, compiled=False, system="prefixflow")
    assert set(sp["spec"]) == {"claim3"}


def test_speedup_table_compares_each_parallel_layout_with_the_single_process_speedup():
    layouts = {"single": (1, 1, 1), "tp2": (2, 2, 1), "dp_shard2": (2, 1, 2)}
    times = {"single": (4.0, 1.0), "tp2": (3.0, 1.0), "dp_shard2": (2.0, 1.0)}  # speedups 4, 3, 2
    rows = []
    for name, (world, tp, shard) in layouts.items():
        for system, t in zip(("baseline", "prefixflow"), times[name], strict=True):
            par = {"parallel_layout": name, "world_size": world, "tp": tp, "dp_shard": shard}
            rows.append(_rec(system, 1280, 256, 16, step_time_s=t, **par))
    rows.append(_rec("baseline", 1280, 256, 8, step_time_s=2.0, parallel_layout="tp2", world_size=2, tp=2))
    rows.append(_rec("prefixflow", 1280, 256, 8, step_time_s=1.0, parallel_layout="tp2", world_size=2, tp=2))
    table = speedup_frame(pd.DataFrame(rows)).set_index(["parallel", "N"])
    assert table.loc[("single", 16), "vs single"] == pytest.approx(1.0)
    assert table.loc[("tp2", 16), "vs single"] == pytest.approx(0.75)
    assert table.loc[("dp_shard2", 16), "vs single"] == pytest.approx(0.5)
    assert table["vs single"].isna().sum() == 1  # N=8 has no single-process cell to compare with


def test_table3_takes_rows_saying_pass_and_rows_saying_passed_together():
    rows = [
        {"model": "m", "parallel": "single", "step": 1, "quantity": q, "max_abs_diff": 1e-5, "pass": True}
        for q in ("G", "L", "W")
    ] + [
        {"model": "m", "parallel": "tp2", "step": 1, "quantity": q, "max_abs_diff": 1e-5, "passed": q != "W"}
        for q in ("G", "L", "W")
    ]
    rows += [  # rows from before `run` existed, beside rows that have it
        {"model": "old", "parallel": "single", "step": 1, "quantity": q, "max_abs_diff": 1e-5, "pass": True}
        for q in ("G", "L", "W")
    ]
    rows[3:6] = [{**r, "run": "prefixflow"} for r in rows[3:6]]
    rows[:6] = [{**r, "microbatch": 1} for r in rows[:6]]
    frame = alignment_frame(pd.DataFrame(rows)).set_index(["model", "parallel"])
    assert frame.loc[("m", "single"), "result"] == "pass" and frame.loc[("m", "tp2"), "result"] == "FAIL"
    assert frame.loc[("old", "single"), "run"] == "prefixflow" and len(frame) == 3
    assert (
        frame.loc[("old", "single"), "microbatch"] == "all" and frame.loc[("m", "tp2"), "microbatch"] == "1"
    )


def test_prefix_grouper_table_compares_in_the_same_cell(tmp_path):
    from harness.figures.tables import peer_frame

    rows = [
        _rec("prefix_grouper", 428, 64, 32, step_time_s=2.0, peak_mem_bytes=100 * MIB, cell_id="auto", git_rev="a"),
        _rec("prefixflow", 428, 64, 32, step_time_s=1.5, peak_mem_bytes=60 * MIB, microbatch=None, cell_id="auto",
             microbatch_auto=True, microbatch_sizes="1,1,30", memory_budget_bytes=100 * MIB, git_rev="a"),
        _rec("prefixflow", 428, 64, 32, step_time_s=3.0, peak_mem_bytes=20 * MIB, cell_id="mb1", git_rev="a"),
        _rec("prefix_grouper", 428, 64, 32, step_time_s=2.5, peak_mem_bytes=100 * MIB, cell_id="mb1", git_rev="a"),
    ]  # fmt: skip
    table = peer_frame(pd.DataFrame(rows)).set_index("microbatch")
    assert (
        table.loc["auto (1,1,30)", "time ÷ peer"] == 0.75 and table.loc["auto (1,1,30)", "peak ÷ peer"] == 0.6
    )
    assert table.loc["1", "time ÷ peer"] == 1.2 and table.loc["1", "peak ÷ peer"] == 0.2
    assert [p.name for p in render_tables(pd.DataFrame(rows), tmp_path)][-2:] == [
        "vs_prefix_grouper.md", "vs_prefix_grouper.tex",
    ]  # fmt: skip


def test_paper_scale_table_reads_estimates_only_beside_the_papers_values(tmp_path):
    from harness.figures.paper_scale import figure10a_paper, paper_scale_table
    from harness.records import ESTIMATE_METER

    rows = []
    for P in (2048, 4096, 6144, 8192, 10240):
        S = 12288 - P
        common = dict(spec="paper_scale", mem_meter=ESTIMATE_METER, microbatch=1)
        rows.append(_rec("baseline", P, S, 2, peak_mem_phase_b_bytes=40 * GIB, **common))
        rows.append(_rec("prefixflow", P, S, 2, peak_mem_phase_b_bytes=(40 - P / 1024) * GIB, **common))
        rows.append(_rec("prefixflow", P, S, 2, offload=True, peak_mem_phase_b_bytes=(30 - P / 1024) * GIB,
                         **common))  # fmt: skip
    estimates = pd.DataFrame(rows)
    table = paper_scale_table(pd.concat([estimates, pd.DataFrame(all_records())], ignore_index=True))
    assert list(table["prefix_len"]) == [2048, 4096, 6144, 8192, 10240]
    assert table["baseline"].tolist() == [40.0] * 5  # the measured records are not read
    assert table["prefixflow+offload/baseline"].iloc[-1] == pytest.approx(20 / 40)
    assert table["paper_prefixflow+offload"].tolist()[0] == 51.6 and np.isnan(
        table["paper_prefixflow+offload"][1]
    )
    assert table["prefixflow+offload/paper"].iloc[-1] == pytest.approx(20 / 26.5)
    assert fixed_total_peaks(estimates).empty  # Figure 10a reads measured records, never estimates
    assert [p.name for p in figure10a_paper(estimates, tmp_path)] == ["fig10a_paper_scale.png"]


def test_paper_frontier_table_reads_each_estimated_search_beside_the_papers_values(tmp_path):
    """Estimated searches (two budgets at the 5/6 split, one fixed prefix) give one row each: the frontier,
    the shortest length over budget (none: the search's max_len fit), the ratio to the baseline's search of
    the same budget and mode, and the paper's 96 GiB values; the CPU Figure 10b never reads them."""
    from harness.figures.common import SkipFigure
    from harness.figures.fig10 import figure10b
    from harness.figures.paper_scale import figure10b_paper, paper_frontier_table
    from harness.records import ESTIMATE_METER
    from harness.run.columns import base_record
    from harness.run.frontier import run_frontier
    from harness.spec.cell import Cell, FrontierSearch, ModelSpec

    def probe(per_token):
        def run(cell):
            rec = {**base_record(cell, "cpu"), "system": cell.systems[0], "offload": cell.offload}
            peak = 16 * GIB + per_token * (cell.prefix_len + cell.suffix_len)
            ok = {"status": "ok", "error": None, "peak_mem_bytes": peak, "mem_meter": ESTIMATE_METER}
            return [{**rec, **ok}]

        return run

    rows = []
    for budget, mode in ((96, "ratio"), (35, "ratio"), (35, "prefix")):
        where = dict(ratio=5 / 6) if mode == "ratio" else dict(prefix_len=18944)
        search = FrontierSearch(budget_bytes=budget * GIB, mode=mode, min_len=4096, max_len=131072,
                                resolution=1024, **where)  # fmt: skip
        for system, offload, per_token in (("baseline", False, 2**19), ("prefixflow", True, 2**18)):
            cell = Cell(spec="paper_frontier", model=ModelSpec(name="llama3:8B"), prefix_len=1, suffix_len=1,
                        n=2, systems=(system,), offload=offload, warmup=0, repeats=1, device="cpu",
                        frontier=search)  # fmt: skip
            rows += run_frontier(cell, tmp_path / f"{budget}{mode}{system}", probe=probe(per_token))
    df = pd.DataFrame(rows)
    t = paper_frontier_table(df).set_index(["mode", "budget_gib", "variant"])
    # 16 GiB + L/2 MiB <= 35 GiB: L <= 38912; with offload L/4 MiB: 77824; at 96 GiB both stop at 131072
    assert t.loc[("ratio", 35.0, "baseline"), "frontier"] == 38912
    assert t.loc[("ratio", 35.0, "prefixflow+offload"), "frontier"] == 77824
    assert t.loc[("ratio", 35.0, "prefixflow+offload"), "vs_baseline"] == pytest.approx(2.0)
    assert t.loc[("ratio", 35.0, "baseline"), "first_over"] == 39936
    assert np.isnan(t.loc[("ratio", 96.0, "prefixflow+offload"), "first_over"])  # max_len fits
    assert t.loc[("ratio", 96.0, "prefixflow+offload"), "paper_96gib"] == 29696
    # the suffix behind the prefix: at most 38912 - 18944 = 19968, on the grid 4096 + k * 1024
    assert t.loc[("prefix", 35.0, "baseline"), "frontier"] == 19456
    assert t.loc[("prefix", 35.0, "prefixflow+offload"), "paper_96gib"] == 10752
    assert [p.name for p in figure10b_paper(df, tmp_path)] == ["fig10b_paper_scale.png"]
    with pytest.raises(SkipFigure):
        figure10b(df, tmp_path)  # measured probes only


def test_paper_fig11_table_scales_each_n_2b_cell_to_n_16_by_the_measured_delta(tmp_path):
    """Each (policy, offload, b) cell at N=2b gets (16 - 2b) x delta, delta being the N=4 minus the N=2 cell
    at b=1 over 2; the whole step's scaled peak decides the 96 GiB fit; the CPU Figure 11 never reads them."""
    from harness.figures.common import SkipFigure
    from harness.figures.paper_scale import GIB as G
    from harness.figures.paper_scale import figure11_paper, paper_fig11_table
    from harness.records import ESTIMATE_METER

    common = dict(spec="paper_fig11", mem_meter=ESTIMATE_METER, status="ok")
    rows = []
    for ac, save in (("selective", 0), ("none", 20)):
        for off in (False, True):
            for b in (1, 2, 4, 8):
                phase_b = (40 + 6 * b + save - 5 * off) * G
                rows.append(_rec("prefixflow", 10240, 4096, 2 * b, ac=ac, offload=off, microbatch=b,
                                 peak_mem_phase_b_bytes=phase_b, peak_mem_bytes=phase_b + G,
                                 cell_id=f"{ac}{off}{b}", **common))  # fmt: skip
    delta = 2**20
    rows.append(_rec("prefixflow", 10240, 4096, 4, ac="selective", offload=False, microbatch=1,
                     peak_mem_phase_b_bytes=46 * G + 2 * delta, peak_mem_bytes=47 * G + 2 * delta,
                     cell_id="delta", **common))  # fmt: skip
    with pytest.raises(SkipFigure):
        figure11_paper(pd.DataFrame(rows[:-1]), tmp_path)  # no delta pair: nothing is scaled by a guess
    t = paper_fig11_table(pd.DataFrame(rows)).set_index(["ac", "offload", "b"])
    assert len(t) == 16 and t.attrs["delta_bytes"] == delta
    assert t.loc[("selective", True, 8), "phase_b_gib"] == 40 + 48 - 5  # N=16 already: nothing added
    assert t.loc[("selective", False, 1), "phase_b_gib"] == pytest.approx(46 + 14 * delta / G)
    assert bool(t.loc[("selective", True, 8), "fits_96gib"]) and not t.loc[("none", False, 8), "fits_96gib"]
    assert t.loc[("none", True, 8), "paper_gib"] == 115.91 and np.isnan(t.loc[("none", True, 4), "paper_gib"])
    assert [p.name for p in figure11_paper(pd.DataFrame(rows), tmp_path)] == ["fig11_paper_scale.png"]
    assert budget_points(pd.DataFrame(rows)).empty  # estimates are not the CPU Figure 11's


def test_paper_table3_table_gives_each_variants_phases_and_every_ranks_peak():
    from harness.figures.common import split_label
    from harness.figures.paper_scale import paper_table3_table
    from harness.records import ESTIMATE_METER

    common = dict(spec="paper_table3", mem_meter=ESTIMATE_METER, status="ok", model="qwen3-32b",
                  parallel_layout="cp2-tp8-pp2", estimate_ranks="[0, 8, 16, 24]")  # fmt: skip
    rows = [
        _rec("baseline", 3072, 1024, 2, offload=False, peak_mem_phase_b_bytes=40 * GIB, cell_id="a",
             peak_mem_bytes_per_rank=json.dumps([40 * GIB, 38 * GIB, 30 * GIB, 30 * GIB]), **common),
        _rec("prefixflow", 3072, 1024, 2, offload=True, peak_mem_phase_a_bytes=20 * GIB,
             peak_mem_phase_b_bytes=30 * GIB, peak_mem_phase_c_bytes=25 * GIB, cell_id="b",
             peak_mem_bytes_per_rank=json.dumps([30 * GIB] * 4), **common),
    ]  # fmt: skip
    t = paper_table3_table(pd.concat([pd.DataFrame(rows), pd.DataFrame(all_records())], ignore_index=True))
    t = t.set_index("variant")
    assert list(t.index) == ["baseline", "prefixflow+offload"]  # the measured records are not read
    assert t.loc["prefixflow+offload", "phase_b_vs_baseline"] == pytest.approx(0.75)
    assert t.loc["baseline", "per_rank_gib"] == [40.0, 38.0, 30.0, 30.0]
    assert np.isnan(t.loc["baseline", "phase_a_gib"])
    assert t.loc["prefixflow+offload", "split"] == split_label(3072, 1024)
