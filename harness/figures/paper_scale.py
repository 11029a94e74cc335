"""Figures 10a, 10b, 11 and Table 3's large settings at the paper's size, estimated: Phase-B peaks
(``results/paper_scale``), capacity frontiers (``results/paper_frontier``), Figure 11's memory axis
(``results/paper_fig11``) and per-rank peaks (``results/paper_table3``), beside the paper's.

The paper (§5.5, Figure 10a; Llama3-8B, TP2×CP4, 12,288 tokens, default SAC, PrefixFlow with offload, rank-max
CUDA-allocated HBM) gives the baseline's Phase-B peak as one value, 64.7 GiB, and PrefixFlow's as four: 51.6,
39.0, 32.8 and 26.5 GiB "as the split moves from 2k/10k to 10k/2k". It names only the ends. Under a peak that
falls linearly with the prefix ratio, each step is proportional to the split spacing; the paper's steps are
12.6, 6.2 and 6.3 GiB, one twice the others, which fits prefixes of 2k, 6k, 8k and 10k (spacings 4k, 2k, 2k).
So 39.0 is matched to 6k/6k and 32.8 to 8k/4k, and 4k/8k has no paper value.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from .common import (
    ESTIMATE_METER,
    GIB,
    SkipFigure,
    estimated,
    frontier_mask,
    mark_revisions,
    save,
    split_label,
    theme,
    variant,
)
from .fig10 import COLORS, VARIANTS, fixed_total_peaks

__all__ = [
    "PAPER_FIG10A_GIB", "PAPER_BASELINE_GIB", "PAPER_FIG10B", "paper_scale_table", "figure10a_paper",
    "paper_frontier_table", "figure10b_paper", "PAPER_FIG11_GIB", "paper_fig11_table", "figure11_paper",
    "paper_table3_table",
]  # fmt: skip

PAPER_BASELINE_GIB = 64.7
PAPER_FIG10A_GIB = {2048: 51.6, 6144: 39.0, 8192: 32.8, 10240: 26.5}  # prefix length -> PrefixFlow + offload
# Figure 10b (96 GiB): the total at the 5/6 split, and the suffix admitted behind an 18,944-token prefix (the
# baseline's whole-sequence limit is below that prefix: it admits none).
PAPER_FIG10B = {
    ("ratio", "baseline"): 17920, ("ratio", "prefixflow+offload"): 29696,
    ("prefix", "baseline"): 0, ("prefix", "prefixflow+offload"): 10752,
}  # fmt: skip
PAPER_BUDGET_GIB = 96.0
# Figure 11 (P=10,240, S=4,096, N=16, offload on) at b=8: full recompute 91.25 GiB (fits), full save an
# extrapolated 115.91 GiB (OOM); without offload both OOM. Offload shifts the points by 4.86 GiB.
PAPER_FIG11_GIB = {("selective", True, 8): 91.25, ("none", True, 8): 115.91}
PAPER_FIG11_N = 16
POLICY = {"selective": "full recompute (SAC)", "none": "full save (AC none)"}


def paper_scale_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per split of the estimated fixed-total cells: each variant's Phase-B peak (GiB), its ratio to the
    baseline, and the paper's value with ours / paper."""
    peaks = fixed_total_peaks(df, rows=estimated)
    if peaks.empty:
        return peaks
    wide = peaks.pivot_table(
        index=["prefix_len", "suffix_len"], columns="variant", values="peak_mem_phase_b_bytes"
    )
    out = (wide / GIB).reset_index()
    out.columns.name = None
    for v in ("prefixflow", "prefixflow+offload"):
        if v in out and "baseline" in out:
            out[f"{v}/baseline"] = out[v] / out["baseline"]
    out["paper_baseline"] = PAPER_BASELINE_GIB
    out["paper_prefixflow+offload"] = out["prefix_len"].map(PAPER_FIG10A_GIB)
    if "baseline" in out:
        out["baseline/paper"] = out["baseline"] / PAPER_BASELINE_GIB
    if "prefixflow+offload" in out:
        out["prefixflow+offload/paper"] = out["prefixflow+offload"] / out["paper_prefixflow+offload"]
    out.attrs = peaks.attrs
    return out


def figure10a_paper(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """Bars: estimated Phase-B peak per split and variant; markers: the paper's values."""
    table = paper_scale_table(df)
    if table.empty or "baseline" not in table:
        raise SkipFigure("no estimated fixed-total records with a baseline (results/paper_scale)")
    theme()
    variants = [v for v in COLORS if v in table]
    fig, ax = plt.subplots(figsize=(7.4, 4.2))
    x = np.arange(len(table))
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        ax.bar(
            x + (i - (len(variants) - 1) / 2) * width,
            table[v],
            width,
            label=f"{v} (estimate)",
            color=COLORS[v],
        )
    ax.axhline(PAPER_BASELINE_GIB, color=COLORS["baseline"], ls="--", lw=1, label="baseline (paper)")
    ax.scatter(x, table["paper_prefixflow+offload"], marker="D", color="black", zorder=3,
               label="prefixflow+offload (paper)")  # fmt: skip
    ax.set_xticks(
        x, [split_label(p, s) for p, s in zip(table["prefix_len"], table["suffix_len"], strict=True)]
    )
    ax.set_xlabel("split P/S (12,288 tokens)")
    ax.set_ylabel("Phase-B peak, rank-max (GiB)")
    ax.legend(fontsize=7)
    n = table.attrs.get("n")
    fig.suptitle(
        "Figure 10a at the paper's size, estimated on fake tensors: Llama3-8B, TP2xCP4, SAC, bf16"
        + (f", N={n}" if n else ""),
        fontsize=9,
    )
    mark_revisions(fig, pd.DataFrame({"git_rev": table.attrs.get("git_rev", [])}), "Figure 10a (paper scale)")
    return [save(fig, out_dir, "fig10a_paper_scale")]


def _variant_order(column: pd.Series) -> pd.Series:
    """A sort key putting the ``variant`` column in Figure 10's order (other columns as they are)."""
    return column.map({v: i for i, v in enumerate(VARIANTS)}) if column.name == "variant" else column


def paper_frontier_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per estimated capacity-frontier search: its budget (GiB), mode (``ratio``: the searched length
    is P+S at a fixed split; ``prefix``: S behind a fixed P), variant, frontier (the largest fitting length),
    the shortest probed length that did not fit (NaN: none did, the search stopped at its ``max_len``), the
    ratio to the baseline's search of the same budget and mode, and the paper's value at its 96 GiB."""
    if df.empty or "mem_meter" not in df.columns:
        return pd.DataFrame()
    p = df[frontier_mask(df) & (df["mem_meter"] == ESTIMATE_METER) & df["status"].isin(["ok", "oom"])]
    if p.empty:
        return pd.DataFrame()
    p = p.assign(variant=variant(p))
    rows = []
    for sid, g in p.groupby("search_id"):
        first = g.iloc[0]
        over = g.loc[~g["fits"].astype(bool), "searched_len"]
        rows.append({
            "budget_gib": float(first["budget_bytes"]) / GIB, "mode": first["frontier_mode"],
            "prefix_len": first["frontier_prefix"] if first["frontier_mode"] == "prefix" else np.nan,
            "variant": first["variant"], "frontier": int(first["frontier_len"]),
            "first_over": float(over.min()) if not over.empty else np.nan,
            "probes": len(g), "search_id": sid, "git_rev": first.get("git_rev"),
        })  # fmt: skip
    out = pd.DataFrame(rows)
    key = ["budget_gib", "mode"]
    base = out[out["variant"] == "baseline"].set_index(key)["frontier"]
    out["vs_baseline"] = [
        f / base.get(tuple(k), np.nan) if base.get(tuple(k), 0) else np.nan
        for f, k in zip(out["frontier"], out[key].itertuples(index=False), strict=True)
    ]
    out["paper_96gib"] = [
        PAPER_FIG10B.get((m, v), np.nan) for m, v in zip(out["mode"], out["variant"], strict=True)
    ]
    out = out.sort_values(["mode", "budget_gib", "variant"], key=_variant_order)
    return out.reset_index(drop=True)


def figure10b_paper(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """Bars: the estimated frontier of each search (left: P+S at the 5/6 split; right: S behind the fixed
    prefix), per budget and variant; markers: the paper's values at 96 GiB."""
    table = paper_frontier_table(df)
    if table.empty:
        raise SkipFigure("no estimated capacity-frontier probes (results/paper_frontier)")
    theme()
    modes = [m for m in ("ratio", "prefix") if m in set(table["mode"])]
    fig, axes = plt.subplots(1, len(modes), figsize=(4.6 * len(modes), 4.0), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        t = table[table["mode"] == mode]
        budgets = sorted(set(t["budget_gib"]))
        variants = [v for v in COLORS if v in set(t["variant"])]
        width = 0.8 / max(1, len(variants))
        for i, v in enumerate(variants):
            vals = [t.loc[(t["budget_gib"] == b) & (t["variant"] == v), "frontier"].max() for b in budgets]
            xs = np.arange(len(budgets)) + (i - (len(variants) - 1) / 2) * width
            bars = ax.bar(xs, vals, width, color=COLORS[v], label=f"{v} (estimate)")
            for bar, b in zip(bars, budgets, strict=True):
                row = t[(t["budget_gib"] == b) & (t["variant"] == v)].iloc[0]
                txt = f"{int(row['frontier'])}" + ("+" if np.isnan(row["first_over"]) else "")
                ax.annotate(txt, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                            va="bottom", fontsize=6)  # fmt: skip
            if PAPER_BUDGET_GIB in budgets:
                x96 = budgets.index(PAPER_BUDGET_GIB) + (i - (len(variants) - 1) / 2) * width
                ax.scatter([x96], [PAPER_FIG10B.get((mode, v), np.nan)], marker="D", color="black", zorder=3,
                           label="paper (96 GiB)" if i == 0 else None)  # fmt: skip
        ax.set_xticks(np.arange(len(budgets)), [f"{b:g} GiB" for b in budgets])
        ax.set_xlabel("budget per rank")
        prefix = t["prefix_len"].dropna()
        ax.set_ylabel("largest fitting P+S (tokens)" if mode == "ratio" else "largest fitting S (tokens)")
        ax.set_title(
            "split 5/6" if mode == "ratio" else f"prefix {int(prefix.iloc[0]) if len(prefix) else '?'}"
        )
        ax.legend(fontsize=6)
    fig.suptitle(
        "Figure 10b at the paper's size, estimated: Llama3-8B, TP2xCP4, SAC, bf16 "
        "(+: the search's max_len fits)",
        fontsize=8,
    )
    mark_revisions(fig, table, "Figure 10b (paper scale)")
    return [save(fig, out_dir, "fig10b_paper_scale")]


def paper_fig11_table(df: pd.DataFrame) -> pd.DataFrame:
    """Figure 11's memory axis from the estimated ``paper_fig11`` cells: per (AC policy, offload, b) the
    peaks at N=2b, scaled to the paper's N=16 by ``delta`` (one response's inputs: the N=4 against the N=2
    cell at b=1; a test shows the peaks grow with N by that alone), whether the whole step fits 96 GiB, and
    the paper's values. Empty without the delta pair."""
    e = estimated(df)
    if e.empty or "spec" not in e.columns:
        return pd.DataFrame()
    e = e[(e["spec"] == "paper_fig11") & (e["system"] == "prefixflow")]
    e = e.assign(offload=e["offload"].astype(bool), b=e["microbatch"].astype(int))
    pair = e[(e["b"] == 1) & (e["ac"] == "selective") & ~e["offload"]].set_index("n")
    if not {2, 4} <= set(pair.index):
        return pd.DataFrame()
    delta = (pair.loc[4, "peak_mem_phase_b_bytes"] - pair.loc[2, "peak_mem_phase_b_bytes"]) / 2
    cells = e[e["n"] == 2 * e["b"]]
    keep = ["ac", "offload", "b", "n", "peak_mem_phase_b_bytes", "peak_mem_bytes", "git_rev"]
    out = cells[[c for c in keep if c in cells.columns]].copy()
    grow = (PAPER_FIG11_N - out["n"]) * delta
    out["phase_b_gib"] = (out["peak_mem_phase_b_bytes"] + grow) / GIB
    out["peak_gib"] = (out["peak_mem_bytes"] + grow) / GIB
    out["fits_96gib"] = out["peak_gib"] <= PAPER_BUDGET_GIB
    out["policy"] = out["ac"].map(POLICY)
    keys = zip(out["ac"], out["offload"], out["b"], strict=True)
    out["paper_gib"] = [PAPER_FIG11_GIB.get(k, np.nan) for k in keys]
    out.attrs["delta_bytes"] = float(delta)
    cols = ["policy", "ac", "offload", "b", "n", "phase_b_gib", "peak_gib", "fits_96gib", "paper_gib"]
    cols += ["git_rev"] if "git_rev" in out.columns else []
    return out[cols].sort_values(["ac", "offload", "b"]).reset_index(drop=True)


def figure11_paper(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """Phase-B peak (scaled to N=16) against b, one line per (AC policy, offload), with the 96 GiB budget and
    the paper's b=8 points."""
    table = paper_fig11_table(df)
    if table.empty:
        raise SkipFigure("no estimated Figure 11 cells with the N=4/N=2 delta pair (results/paper_fig11)")
    theme()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (ac, off), g in table.groupby(["ac", "offload"]):
        ls = "-" if off else "--"
        ax.plot(g["b"], g["phase_b_gib"], ls, marker="o", label=f"{POLICY[ac]}{', offload' if off else ''}")
    paper = [(b, v, ac) for (ac, off, b), v in PAPER_FIG11_GIB.items()]
    ax.scatter([p[0] for p in paper], [p[1] for p in paper], marker="D", color="black", zorder=3,
               label="paper, offload (b=8)")  # fmt: skip
    ax.axhline(PAPER_BUDGET_GIB, color="red", ls=":", lw=1, label="96 GiB")
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
    ax.set_xlabel("responses per Phase-B microbatch b")
    ax.set_ylabel("Phase-B peak at N=16, rank-max (GiB)")
    ax.legend(fontsize=6)
    fig.suptitle(
        "Figure 11's memory axis at the paper's size, estimated: Llama3-8B, TP2xCP4, P=10240, S=4096, N=16",
        fontsize=8,
    )
    mark_revisions(fig, table, "Figure 11 (paper scale)")
    return [save(fig, out_dir, "fig11_paper_scale")]


def paper_table3_table(df: pd.DataFrame) -> pd.DataFrame:
    """Table 3's large settings from the estimated ``paper_table3`` cells: per model, layout and variant the
    rank-max peak of each phase (GiB), the whole step's peak on every rank that ran, and the ratio of the
    Phase-B peak to the baseline's of the same model and layout."""
    e = estimated(df)
    if e.empty or "spec" not in e.columns:
        return pd.DataFrame()
    e = e[e["spec"] == "paper_table3"]
    if e.empty:
        return pd.DataFrame()
    e = e.assign(variant=variant(e))
    rows = []
    for r in e.to_dict("records"):
        per_rank = r.get("peak_mem_bytes_per_rank")  # a JSON list in the records
        per_rank = json.loads(per_rank) if isinstance(per_rank, str) else per_rank
        rows.append({
            "model": r["model"], "layout": r["parallel_layout"], "variant": r["variant"],
            "split": split_label(r["prefix_len"], r["suffix_len"]),
            **{f"phase_{p}_gib": (r.get(f"peak_mem_phase_{p}_bytes") or np.nan) / GIB for p in "abc"},
            "ranks": r.get("estimate_ranks"),
            "per_rank_gib": [round(float(x) / GIB, 2) for x in per_rank] if per_rank is not None else None,
        })  # fmt: skip
    out = pd.DataFrame(rows)
    base = out[out["variant"] == "baseline"].set_index(["model", "layout"])["phase_b_gib"]
    out["phase_b_vs_baseline"] = [
        b / base.get((m, lay), np.nan)
        for b, m, lay in zip(out["phase_b_gib"], out["model"], out["layout"], strict=True)
    ]
    return out.sort_values(["model", "variant"], key=_variant_order).reset_index(drop=True)
