"""Figure 11: Phase-B time vs Phase-B peak for suffix microbatch b x AC policy x offload."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from .common import (
    ESTIMATE_METER,
    SkipFigure,
    flag,
    frontier_mask,
    mark_revisions,
    mem_unit,
    restrict_to_mode,
    save,
    split_label,
    theme,
)

AC_LABELS = {"none": "full save (AC none)", "selective": "selective AC", "full": "full AC"}


def budget_points(df: pd.DataFrame) -> pd.DataFrame:
    """PrefixFlow records (ok and failed) of the (P, S, N) setting with the most (b, ac, offload) combos."""
    if df.empty or "microbatch" not in df.columns or "system" not in df.columns:
        return pd.DataFrame()
    m = df[
        (df["system"] == "prefixflow") & ~frontier_mask(df) & df["microbatch"].notna() & ~flag(df, "compile")
    ]
    if "mem_meter" in m.columns:  # estimates are Figure 11 at the paper's size (figure11_paper)
        m = m[m["mem_meter"] != ESTIMATE_METER]
    if m.empty:
        return m
    m = m.assign(
        offload=flag(m, "offload"),
        ac=m["ac"].fillna("default").astype(str) if "ac" in m.columns else "default",
    )
    m = m.assign(_spec=m["spec"].astype(str) if "spec" in m.columns else "")
    keys = ["_spec", "prefix_len", "suffix_len", "n"]
    combos = m[[*keys, "microbatch", "ac", "offload"]].drop_duplicates().groupby(keys).size()
    spec, p, s, n = combos.idxmax()
    m = m[(m["_spec"] == spec) & (m["prefix_len"] == p) & (m["suffix_len"] == s) & (m["n"] == n)]
    # one measurement protocol: cells of other figures at the same (P, S, N) may have fewer repeats
    return restrict_to_mode(m, ["model", "dtype", "device", "layout", "warmup", "repeats"])


def figure11(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """Scatter with one line per (AC policy, offload) through b = 1, 2, 4, 8; OOM settings listed."""
    pts = budget_points(df)
    ok = pts[pts["status"] == "ok"] if not pts.empty else pts
    if ok.empty or ok["microbatch"].nunique() < 2:
        raise SkipFigure("no PrefixFlow records over at least two suffix microbatch sizes")
    theme()
    ok = ok.groupby(["ac", "offload", "microbatch"], as_index=False)[
        ["phase_b_s", "peak_mem_phase_b_bytes"]
    ].median()
    scale, unit = mem_unit(ok["peak_mem_phase_b_bytes"])
    policies = sorted(ok["ac"].unique())
    palette = dict(zip(policies, sns.color_palette("tab10", len(policies)), strict=True))
    fig, ax = plt.subplots(figsize=(8.4, 4.4))
    for (ac, off), g in ok.groupby(["ac", "offload"]):
        g = g.sort_values("microbatch")
        ax.plot(
            g["peak_mem_phase_b_bytes"] / scale,
            g["phase_b_s"],
            "--" if off else "-",
            marker="s" if off else "o",
            color=palette[ac],
            label=f"{AC_LABELS.get(ac, ac)}, offload {'on' if off else 'off'}",
        )
        for x, y, b in zip(g["peak_mem_phase_b_bytes"] / scale, g["phase_b_s"], g["microbatch"], strict=True):
            ax.annotate(f"b={int(b)}", (x, y), textcoords="offset points", xytext=(4, 3), fontsize=6)
    failed = pts[pts["status"] != "ok"]
    if not failed.empty:
        lines = sorted({
            f"b={int(r.microbatch)} {r.ac}, offload {'on' if r.offload else 'off'}: {r.status}"
            for r in failed.itertuples()
        })  # fmt: skip
        ax.text(  # outside the axes, under the legend: no data is covered
            1.02,
            0.0,
            "\n".join(lines),
            transform=ax.transAxes,
            ha="left",
            va="bottom",
            fontsize=6,
            bbox={"boxstyle": "round", "fc": "white", "ec": "0.7"},
        )
    ax.set_xlabel(f"Phase-B peak memory ({unit})")
    ax.set_ylabel("Phase-B time (s)")
    first = pts.iloc[0]
    ax.set_title(
        f"Figure 11: suffix budget ({split_label(first.prefix_len, first.suffix_len)}, N={int(first.n)})"
    )
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)  # beside the data
    mark_revisions(fig, pts, "Figure 11")
    return [save(fig, out_dir, "fig11_suffix_budget")]
