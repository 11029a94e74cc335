"""The tree figures and tables (harness.figures.trees) are pure functions of the records."""

from __future__ import annotations

import pandas as pd

from harness.figures import render_all, render_tables
from harness.figures.common import measured
from harness.figures.trees import tree_best, tree_frame, tree_pareto


def records() -> pd.DataFrame:
    rows = []
    for cell, mb, times, peaks in [
        ("c1", float("nan"), [1.0, 0.4, 0.6, 0.5, 0.7], [100, 40, 60, 50, 20]),
        ("c2", 1.0, [1.2, 0.6, 0.9, 1.0, 0.8], [30, 25, 28, 20, 20]),
    ]:
        for system, t, p in zip(["baseline", "prefixflow", "prefixflow_flat", "tree_mask", "dfs_relay"],
                                times, peaks, strict=True):  # fmt: skip
            rows.append(dict(
                cell_id=cell, spec="trees", system=system, status="ok", step_time_s=t, peak_mem_bytes=p * 2**20,
                counted_flops=10.0 / (1 if system == "baseline" else 4), workload="agentic",
                workload_label="agentic x", unique_token_ideal=3.0, tree_shared_fraction=0.67, tree_levels=4,
                layout="padded", microbatch=mb, git_rev="abc",
            ))  # fmt: skip
    return pd.DataFrame(rows)


def test_speedups_are_per_cell_and_tree_rows_stay_out_of_other_figures():
    df = records()
    m = tree_frame(df)
    pf = m[m["system"] == "prefixflow"].set_index("cell_id")
    assert pf.loc["c1", "speedup"] == 1.0 / 0.4 and pf.loc["c2", "speedup"] == 1.2 / 0.6
    assert pf.loc["c1", "of_ideal"] == (1.0 / 0.4) / 3.0 and pf.loc["c1", "flop_ideal"] == 4.0
    best = tree_best(df).set_index("system")
    assert (
        best.loc["prefixflow", "config"] == "padded b=all" and best.loc["dfs_relay", "config"] == "padded b=1"
    )
    assert measured(df).empty  # tree cells are read by their own figures only


def test_pareto_names_dominating_configurations():
    p = tree_pareto(records()).set_index("peer")
    # dfs_relay at 20 MiB: no PrefixFlow configuration has a peak that low
    assert p.loc["dfs_relay", "dominated"] == 0 and p.loc["tree_mask", "dominated"] == 1  # not its 20 MiB one
    assert p.loc["baseline", "dominated"] == 2


def test_figures_and_tables_render(tmp_path):
    made = render_all(records(), tmp_path, only=["trees_speedup", "trees_time_memory"])
    assert sorted(x.name for x in made) == ["trees_speedup.png", "trees_time_memory.png"]
    tables = {x.name for x in render_tables(records(), tmp_path)}
    assert {"trees_shapes.md", "trees_best.md", "trees_pareto.md"} <= tables
