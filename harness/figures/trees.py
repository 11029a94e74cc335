"""Trees in practice (issue 22), pure functions of the records of tree cells (``workload`` set):

- :func:`tree_speedup`: each system's speedup over the baseline measured in the same cell (best layout and
  microbatch per shape), against the unique-token ideal (path tokens / unique tokens), every system on one plot;
- :func:`tree_time_memory`: the time-memory plane per shape, every system's configurations;
- :func:`tree_tables`: the shape table, the best configuration per shape and system, and the Pareto check.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from .common import MIB, SkipFigure, mark_revisions, save, theme

__all__ = ["TREE_SYSTEMS", "tree_frame", "tree_best", "tree_pareto", "tree_speedup", "tree_time_memory",
           "tree_tables", "tree_vs_flat"]  # fmt: skip

TREE_SYSTEMS = ("prefixflow", "prefixflow_auto", "prefixflow_flat", "tree_mask", "dfs_relay", "baseline")
PEERS = ("baseline", "prefixflow_flat", "tree_mask", "dfs_relay")


def _config(r) -> str:
    """``layout b=microbatch``, with ``+offload`` where a PrefixFlow system ran with PrefixFlowConfig.offload
    (the cell's other systems ignore the flag)."""
    mb = "all" if pd.isna(r["microbatch"]) else str(int(r["microbatch"]))
    off = " +offload" if bool(r.get("offload", False)) and str(r["system"]).startswith("prefixflow") else ""
    return f"{r['layout']} b={mb}{off}"


def tree_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Successful tree records with ``speedup`` (baseline step / this step, same cell), ``of_ideal`` (speedup
    over the unique-token ideal), ``flop_ideal`` (baseline counted FLOPs / this system's) and ``of_flop_ideal``."""
    if df.empty or "workload" not in df.columns:
        return pd.DataFrame()
    m = df[(df["status"] == "ok") & df["workload"].notna()].copy()
    if m.empty:
        return m
    base = m[m["system"] == "baseline"].set_index("cell_id")
    m = m[m["cell_id"].isin(base.index)]
    m["speedup"] = m["cell_id"].map(base["step_time_s"]) / m["step_time_s"]
    m["of_ideal"] = m["speedup"] / m["unique_token_ideal"]
    if "counted_flops" in m.columns:
        m["flop_ideal"] = m["cell_id"].map(base["counted_flops"]) / m["counted_flops"]
        m["of_flop_ideal"] = m["speedup"] / m["flop_ideal"]
    m["config"] = m.apply(_config, axis=1)
    m["peak_mib"] = m["peak_mem_bytes"] / MIB
    return m.reset_index(drop=True)


def _shapes(m: pd.DataFrame) -> list[str]:
    order = m.groupby("workload_label")["unique_token_ideal"].first().sort_values()
    return list(order.index)


def tree_best(df: pd.DataFrame) -> pd.DataFrame:
    """Per shape and system: the configuration with the highest speedup, with its peak and FLOP ideal."""
    m = tree_frame(df)
    if m.empty:
        return m
    idx = m.groupby(["workload_label", "system"])["speedup"].idxmax()
    cols = ["workload_label", "system", "config", "step_time_s", "speedup", "of_ideal", "flop_ideal",
            "of_flop_ideal", "peak_mib", "unique_token_ideal", "tree_shared_fraction", "tree_levels"]  # fmt: skip
    return m.loc[idx, [c for c in cols if c in m.columns]].reset_index(drop=True)


def tree_pareto(df: pd.DataFrame) -> pd.DataFrame:
    """Per shape and peer configuration: the PrefixFlow tree configurations (``prefixflow``, ``prefixflow_auto``,
    any layout and microbatch, all cells of the shape) with a peak <= the peer's and a median step time <= the
    peer's; aggregated per shape and peer (``dominated`` of ``configs``)."""
    m = tree_frame(df)
    if m.empty:
        return m
    rows = []
    for shape, g in m.groupby("workload_label"):
        pf = g[g["system"].isin(["prefixflow", "prefixflow_auto"])]
        for peer in PEERS:
            p = g[g["system"] == peer]
            if p.empty or pf.empty:
                continue
            for _, ref in p.iterrows():
                dom = pf[
                    (pf["peak_mem_bytes"] <= ref["peak_mem_bytes"])
                    & (pf["step_time_s"] <= ref["step_time_s"])
                ]
                rows.append({"shape": shape, "peer": peer, "peer_config": ref["config"],
                             "peer_s": ref["step_time_s"], "peer_peak_mib": ref["peak_mib"],
                             "dominated_by": ", ".join(dom["system"] + " " + dom["config"]) or "-", "ok": not dom.empty})  # fmt: skip
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    agg = out.groupby(["shape", "peer"]).agg(
        configs=("ok", "size"), dominated=("ok", "sum"), best_peer_s=("peer_s", "min"),
        peer_peak_mib=("peer_peak_mib", "min"),
    )  # fmt: skip
    return agg.reset_index()


def tree_vs_flat(df: pd.DataFrame) -> pd.DataFrame:
    """Per shape: PrefixFlow on the tree against flat PrefixFlow measured in the same cell (``prefixflow_flat``
    step / ``prefixflow`` step), the median and best over the shape's cells."""
    m = tree_frame(df)
    if m.empty:
        return m
    t = m.pivot_table(index=["workload_label", "cell_id"], columns="system", values="step_time_s")
    if not {"prefixflow", "prefixflow_flat"} <= set(t.columns):
        return pd.DataFrame()
    ratio = (t["prefixflow_flat"] / t["prefixflow"]).rename("ratio").reset_index()
    shape = m.groupby("workload_label")[["tree_levels", "tree_shared_fraction"]].first()
    out = ratio.groupby("workload_label")["ratio"].agg(median="median", best="max", cells="count")
    return shape.join(out).reset_index()


def tree_speedup(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    best = tree_best(df)
    if best.empty:
        raise SkipFigure("no tree-cell records")
    theme()
    shapes = _shapes(best)
    systems = [s for s in TREE_SYSTEMS if s in set(best["system"]) and s != "baseline"]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.3 * len(shapes)), 4.2))
    x = np.arange(len(shapes))
    width = 0.8 / max(1, len(systems))
    for i, s in enumerate(systems):
        sp = best[best["system"] == s].set_index("workload_label")["speedup"].reindex(shapes)
        ax.bar(x + (i - (len(systems) - 1) / 2) * width, sp.values, width, label=s)
    ideal = best.groupby("workload_label")["unique_token_ideal"].first().reindex(shapes)
    ax.scatter(x, ideal.values, marker="_", s=900, color="black", zorder=5, label="unique-token ideal")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(x, [s.replace(" ", "\n", 1) for s in shapes], fontsize=7)
    ax.set_ylabel("speedup over the baseline (same cell)")
    ax.legend(fontsize=7, ncol=3)
    ax.set_title("Tree workloads: speedup vs the unique-token ideal (best layout/microbatch)")
    mark_revisions(fig, tree_frame(df), "tree speedup")
    return [save(fig, out_dir, "trees_speedup")]


def tree_time_memory(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    m = tree_frame(df)
    if m.empty:
        raise SkipFigure("no tree-cell records")
    theme()
    shapes = _shapes(m)
    cols = min(3, len(shapes))
    rows = -(-len(shapes) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    markers = dict(zip(TREE_SYSTEMS, "oPsDv^", strict=True))
    for k, shape in enumerate(shapes):
        ax = axes[k // cols, k % cols]
        g = m[m["workload_label"] == shape]
        for s in TREE_SYSTEMS:
            p = g[g["system"] == s]
            if not p.empty:
                ax.scatter(p["peak_mib"], p["step_time_s"], marker=markers[s], label=s, s=28)
        ax.set_title(shape, fontsize=8)
        ax.set_xlabel("peak memory (MiB, CPU live bytes)", fontsize=7)
        ax.set_ylabel("median step time (s)", fontsize=7)
    for k in range(len(shapes), rows * cols):
        axes[k // cols, k % cols].axis("off")
    axes[0, 0].legend(fontsize=6)
    fig.suptitle("Tree workloads: the time-memory plane (every system's configurations)")
    mark_revisions(fig, m, "tree time-memory")
    return [save(fig, out_dir, "trees_time_memory")]


def tree_tables(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    from .tables import _write

    best = tree_best(df)
    if best.empty:
        raise SkipFigure("no tree-cell records")
    shapes = best.groupby("workload_label").first()[
        ["tree_shared_fraction", "tree_levels", "unique_token_ideal"]
    ]
    paths = _write(
        out_dir, "trees_shapes", shapes.reset_index(), "Tree workloads: shared fraction, levels, ideal"
    )
    paths += _write(
        out_dir, "trees_best", best, "Best configuration per shape and system (speedup: same cell)"
    )
    flat = tree_vs_flat(df)
    if not flat.empty:
        paths += _write(out_dir, "trees_vs_flat", flat, "PrefixFlow trees vs flat PrefixFlow, same cell")
    pareto = tree_pareto(df)
    if not pareto.empty:
        paths += _write(
            out_dir, "trees_pareto", pareto, "PrefixFlow (trees) configurations dominating each peer"
        )
    return paths
