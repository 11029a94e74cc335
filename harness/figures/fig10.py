"""Figure 10: (a) Phase-B peak memory at a fixed total length across splits; (b) capacity frontier."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from .common import (
    ESTIMATE_METER,
    SkipFigure,
    as_key,
    flag,
    frontier_mask,
    mark_revisions,
    measured,
    mem_unit,
    restrict_to_mode,
    save,
    split_label,
    theme,
    variant,
)

VARIANTS = ("baseline", "prefixflow", "prefixflow+offload")
COLORS = {"baseline": "#7f7f7f", "prefixflow": "#1f77b4", "prefixflow+offload": "#2ca02c"}


def fixed_total_peaks(df: pd.DataFrame, rows=measured) -> pd.DataFrame:
    """Median Phase-B peak per (split, variant) at the total length with the most splits (eager only), of the
    ``rows`` of ``df`` (measured records; :func:`~.common.estimated` for the paper-scale estimates)."""
    m = rows(df)
    if m.empty or "peak_mem_phase_b_bytes" not in m.columns:
        return pd.DataFrame()
    m = m[~flag(m, "compile") & m["peak_mem_phase_b_bytes"].notna()]
    m = m.assign(variant=variant(m), total=m["prefix_len"] + m["suffix_len"])
    m = m[m["variant"].isin(VARIANTS)]
    if m.empty:
        return pd.DataFrame()
    # the (spec, total length, N) with the most variants, then the most splits
    m = m.assign(_spec=m["spec"].astype(str) if "spec" in m.columns else "")
    g = m.groupby(["_spec", "total", "n"])
    score = pd.DataFrame({"v": g["variant"].nunique(), "s": g["prefix_len"].nunique()})
    spec, total, n = score.sort_values(["v", "s"], ascending=False).index[0]
    m = m[(m["_spec"] == spec) & (m["total"] == total) & (m["n"] == n)]
    m = restrict_to_mode(m, ["model", "dtype", "device"])
    # within each variant, one setting of layout and AC (the most common); one panel per microbatch
    m = pd.concat([restrict_to_mode(g, ["layout", "ac"]) for _, g in m.groupby("variant")])
    m = m.assign(microbatch=as_key(m["microbatch"]) if "microbatch" in m.columns else "None")
    out = m.groupby(["microbatch", "prefix_len", "suffix_len", "variant"], as_index=False)[
        "peak_mem_phase_b_bytes"
    ].median()
    # panels are comparisons: where some microbatch settings have baseline records, keep only those
    with_base = set(out.loc[out["variant"] == "baseline", "microbatch"])
    if with_base:
        out = out[out["microbatch"].isin(with_base)]
    out = out.sort_values(["microbatch", "prefix_len", "variant"]).reset_index(drop=True)
    out.attrs["n"] = int(n)
    out.attrs["git_rev"] = list(m["git_rev"].dropna().astype(str)) if "git_rev" in m.columns else []
    return out


def _mb_order(mb: str) -> tuple[bool, float]:
    try:
        value = float(mb)
    except ValueError:
        return (True, 0.0)
    return (value != value, 0.0 if value != value else value)  # NaN (all responses) last


def _mb_label(mb: str, n: int | None) -> str:
    if _mb_order(mb)[0] or mb in ("nan", "None"):
        return "suffix microbatch: all responses"
    b = int(float(mb))
    return f"suffix microbatch {b}" + (" (= N: one wave)" if n is not None and b == n else "")


def figure10a(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """Grouped bars: Phase-B peak per split for baseline, PrefixFlow, PrefixFlow+offload; one panel per
    suffix microbatch setting, each bar labelled with its change against the baseline."""
    peaks = fixed_total_peaks(df)
    if peaks.empty or peaks["variant"].nunique() < 2:
        raise SkipFigure("no Phase-B peak records of at least two systems at a common total length")
    theme()
    mbs = sorted(peaks["microbatch"].unique(), key=_mb_order)
    n = int(peaks.attrs.get("n", 0)) or None
    fig, axes = plt.subplots(1, len(mbs), figsize=(6.4 * len(mbs), 4.2), squeeze=False)
    for ax, mb in zip(axes[0], mbs, strict=True):  # own y scale per panel: b=N can be ~N times b=1
        sub = peaks[peaks["microbatch"] == mb]
        scale, unit = mem_unit(sub["peak_mem_phase_b_bytes"])
        _bars(ax, sub, scale)
        ax.set_title(_mb_label(mb, n), fontsize=9)
        ax.set_ylabel(f"Phase-B peak memory ({unit})")
        ax.set_ylim(0, np.nanmax(sub["peak_mem_phase_b_bytes"]) / scale * 1.25)
    total = int(peaks["prefix_len"].iloc[0] + peaks["suffix_len"].iloc[0])
    fig.suptitle(f"Figure 10a: Phase-B peak at fixed total length {total}" + (f", N={n}" if n else ""))
    mark_revisions(fig, pd.DataFrame({"git_rev": peaks.attrs.get("git_rev", [])}), "Figure 10a")
    return [save(fig, out_dir, "fig10a_phase_b_peak")]


def _bars(ax, peaks: pd.DataFrame, scale: float) -> None:
    splits = peaks[["prefix_len", "suffix_len"]].drop_duplicates().sort_values("prefix_len")
    labels = [split_label(p, s) for p, s in splits.itertuples(index=False)]
    present = [v for v in VARIANTS if v in set(peaks["variant"])]
    width = 0.8 / len(present)
    x = np.arange(len(labels))
    base = peaks[peaks["variant"] == "baseline"].set_index("prefix_len")["peak_mem_phase_b_bytes"]
    for i, v in enumerate(present):
        sub = peaks[peaks["variant"] == v].set_index("prefix_len")["peak_mem_phase_b_bytes"]
        ys = [sub.get(p, np.nan) / scale for p in splits["prefix_len"]]
        bars = ax.bar(x + (i - (len(present) - 1) / 2) * width, ys, width, label=v, color=COLORS[v])
        if v == "baseline":
            continue
        for bar, p in zip(bars, splits["prefix_len"], strict=True):
            b, y = base.get(p, np.nan), sub.get(p, np.nan)
            if np.isfinite(b) and np.isfinite(y) and b > 0:
                ax.annotate(
                    f"{(y / b - 1) * 100:+.0f}%",
                    (bar.get_x() + bar.get_width() / 2, y / scale),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
    ax.set_xticks(x, labels)
    ax.set_xlabel("split P/S (fixed total length)")
    ax.legend(fontsize=7, loc="upper center", ncol=len(present))


def search_label(df: pd.DataFrame) -> pd.Series:
    """Which search a probe belongs to: ``ratio 0.833`` or ``prefix 2048`` ("" when the rows do not say)."""
    if "frontier_mode" not in df.columns:
        return pd.Series("", index=df.index, dtype=object)
    fixed = np.where(df["frontier_mode"] == "prefix", df.get("frontier_prefix"), df.get("frontier_ratio"))
    return pd.Series(
        [
            f"{m} {float(x):.4g}" if isinstance(m, str) else ""
            for m, x in zip(df["frontier_mode"], fixed, strict=True)
        ],
        index=df.index,
        dtype=object,
    )


def frontier_table(
    df: pd.DataFrame, budget: float | None = None, search: str | None = None
) -> tuple[pd.DataFrame, pd.DataFrame, float]:
    """Frontier probes and the largest fitting total length per variant.

    A probe fits when its status is ``ok`` and its peak (``peak_mem_bytes``) is within the budget. The
    budget defaults to the most common ``budget_bytes`` among the probes; passing one re-reads the same
    probes under another budget (probes the search recorded as ``oom`` never fit). Probes of one search
    setting are read (``search``, see :func:`search_label`; default: the one with the most probes), so a
    fixed-ratio and a fixed-prefix search never mix. Returns ``(probes, frontier, budget)``.
    """
    if df.empty or "status" not in df.columns:
        return pd.DataFrame(), pd.DataFrame(), float("nan")
    p = df[frontier_mask(df)]
    if p.empty:
        return p, pd.DataFrame(), float("nan")
    p = p.assign(search=search_label(p))
    p = p[p["search"] == (p["search"].value_counts().idxmax() if search is None else search)]
    if p.empty:
        return p, pd.DataFrame(), float("nan")
    if budget is None:
        budget = float(p["budget_bytes"].value_counts().idxmax()) if "budget_bytes" in p.columns else np.inf
        if "budget_bytes" in p.columns:
            p = p[p["budget_bytes"] == budget]
    peak = p["peak_mem_bytes"].astype(float) if "peak_mem_bytes" in p.columns else np.nan
    fits = (p["status"] == "ok") & ~(peak > budget)
    p = p.assign(variant=variant(p), total=p["prefix_len"] + p["suffix_len"], fits=fits)
    rows = []
    for v, g in p.groupby("variant"):
        ok = g[g["fits"]]
        best = ok.loc[ok["total"].idxmax()] if not ok.empty else None
        rows.append({
            "variant": v,
            "max_total": int(best["total"]) if best is not None else 0,
            "prefix_len": int(best["prefix_len"]) if best is not None else 0,
            "suffix_len": int(best["suffix_len"]) if best is not None else 0,
            "probes": len(g),
        })  # fmt: skip
    front = pd.DataFrame(rows)
    if "baseline" in set(front["variant"]) and front.loc[front["variant"] == "baseline", "max_total"].iloc[0]:
        base = front.loc[front["variant"] == "baseline", "max_total"].iloc[0]
        front["vs_baseline"] = front["max_total"] / base
    return p.reset_index(drop=True), front, budget


def figure10b(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """Left: every probe's peak vs total length against the budget; right: the frontier per variant. Measured
    probes only (estimated ones are Figure 10b at the paper's size, ``figure10b_paper``)."""
    if "mem_meter" in df.columns:
        df = df[df["mem_meter"] != ESTIMATE_METER]
    probes, front, budget = frontier_table(df)
    if front.empty:
        raise SkipFigure("no capacity-frontier probe records (budget_bytes/probe)")
    theme()
    scale, unit = mem_unit(list(probes["peak_mem_bytes"].dropna()) + [budget if np.isfinite(budget) else 0])
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(9.0, 3.8))
    for v, g in probes.groupby("variant"):
        color = COLORS.get(v, "#9467bd")
        g = g.sort_values("total")
        for fits, mk in ((True, "o"), (False, "x")):
            s = g[g["fits"] == fits]
            ax0.plot(
                s["total"],
                s["peak_mem_bytes"] / scale,
                mk,
                color=color,
                label=v if fits else None,
                mfc=color if fits else "none",
            )
    if np.isfinite(budget):
        ax0.axhline(budget / scale, color="red", ls="--", lw=1, label="budget")
    ax0.set_xlabel("total length P+S (tokens)")
    ax0.set_ylabel(f"peak memory ({unit})")
    ax0.set_title("probes (x = does not fit)")
    ax0.legend(fontsize=7)
    order = [v for v in VARIANTS if v in set(front["variant"])] + sorted(
        set(front["variant"]) - set(VARIANTS)
    )
    f = front.set_index("variant").loc[order]
    bars = ax1.bar(order, f["max_total"], color=[COLORS.get(v, "#9467bd") for v in order])
    for bar, (v, row) in zip(bars, f.iterrows(), strict=True):
        txt = f"{int(row['max_total'])}"
        if "vs_baseline" in f.columns and np.isfinite(row.get("vs_baseline", np.nan)) and v != "baseline":
            txt += f"\n{row['vs_baseline']:.2f}x"
        ax1.annotate(
            txt, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7
        )
    ax1.set_ylim(0, max(1, f["max_total"].max()) * 1.18)  # room for the labels
    ax1.set_ylabel("largest fitting P+S (tokens)")
    where = f" ({probes['search'].iloc[0]})" if probes["search"].iloc[0] else ""
    ax1.set_title(
        (f"frontier under {budget / scale:.2f} {unit}" if np.isfinite(budget) else "frontier") + where
    )
    ax1.tick_params(axis="x", labelsize=7)
    fig.suptitle("Figure 10b: capacity frontier")
    mark_revisions(fig, probes, "Figure 10b")
    return [save(fig, out_dir, "fig10b_capacity_frontier")]
