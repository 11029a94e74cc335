"""Vision-language prompts (issue 32, ``experiments/multimodal.yaml``): PrefixFlow's speedup and Phase-B peak
against the baseline on chart-QA and video prompts, the tower trained and frozen, and the prompts' prefix
ratios beside the paper's Table 1."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from .common import SkipFigure, flag, mark_revisions, save, theme

__all__ = ["vision_frame", "vision_summary", "figure_multimodal", "multimodal_table", "PAPER_TABLE1"]

# The paper's Table 1 as its text gives it (§1, §5.4): median prefix ratios, video RLVR 98.0%; chart QA (with
# diagram QA and fixed-context RAG) within 75.8-87.6%.
PAPER_TABLE1 = {"chart_qa": (0.758, 0.876), "video": (0.980, 0.980)}
_NAMES = {"chart_qa": "chart QA", "video": "video"}


def vision_frame(df: pd.DataFrame) -> pd.DataFrame:
    """PrefixFlow's ok vision records with the baseline of the same cell: ``speedup`` (baseline step / ours),
    ``flop_ideal`` (baseline counted FLOPs / ours), ``of_flop_ideal`` and ``phase_b_ratio`` (our Phase-B peak
    over the baseline's peak)."""
    if df.empty or "vision_workload" not in df.columns:
        return pd.DataFrame()
    m = df[(df["status"] == "ok") & df["vision_workload"].notna()]
    base = m[m["system"] == "baseline"].set_index("cell_id")
    ours = m[(m["system"] == "prefixflow") & m["cell_id"].isin(base.index)].copy()
    if ours.empty:
        return ours
    at = ours["cell_id"]
    ours["speedup"] = at.map(base["step_time_s"]) / ours["step_time_s"]
    ours["flop_ideal"] = at.map(base["counted_flops"]) / ours["counted_flops"]
    ours["of_flop_ideal"] = ours["speedup"] / ours["flop_ideal"]
    ours["phase_b_ratio"] = ours["peak_mem_phase_b_bytes"] / at.map(base["peak_mem_phase_b_bytes"])
    ours["offload"] = flag(ours, "offload")
    return ours.sort_values(["vision_workload", "tower", "offload", "n"]).reset_index(drop=True)


def vision_summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per vision cell: workload, tower, offload, N, prefix ratio, speedup, its FLOP ideal, Phase-B ratio."""
    m = vision_frame(df)
    cols = ["vision_workload", "tower", "offload", "n", "visual_tokens", "vision_prefix_ratio", "speedup",
            "flop_ideal", "of_flop_ideal", "phase_b_ratio", "step_time_s", "vision_runs"]  # fmt: skip
    return m[cols] if not m.empty else m


def figure_multimodal(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """Three panels: speedup vs N (with the executed-FLOP ideal), Phase-B peak over the baseline's at the
    largest N (with and without offload), and the prompts' prefix ratios beside the paper's Table 1."""
    m = vision_frame(df)
    if m.empty:
        raise SkipFigure("no vision-language records (experiments/multimodal.yaml)")
    theme()
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.3))
    colors = {("chart_qa", "trained"): "#1f77b4", ("chart_qa", "frozen"): "#9ecae1",
              ("video", "trained"): "#d62728", ("video", "frozen"): "#fc9272"}  # fmt: skip
    plain = m[~m["offload"]]
    for (kind, tower), g in plain.groupby(["vision_workload", "tower"]):
        c = colors.get((kind, tower), "gray")
        ax1.plot(g["n"], g["speedup"], "o-", color=c, label=f"{_NAMES.get(kind, kind)}, tower {tower}")
        ax1.plot(g["n"], g["flop_ideal"], "_", color=c, markersize=16, markeredgewidth=2)
    ax1.set(xscale="log", yscale="log", xlabel="responses per group N", ylabel="speedup over the baseline",
            title="Speedup (bars: executed-FLOP ideal)")  # fmt: skip
    ax1.set_xticks(sorted(plain["n"].unique()), [str(int(n)) for n in sorted(plain["n"].unique())])
    ax1.xaxis.set_minor_formatter(plt.NullFormatter())
    ax1.legend(fontsize=7)
    top = m[m["n"] == m["n"].max()]
    labels, values, shades = [], [], []
    for (kind, tower, off), g in top.groupby(["vision_workload", "tower", "offload"]):
        labels.append(f"{_NAMES.get(kind, kind)}\n{tower}{' +offload' if off else ''}")
        values.append(float(g["phase_b_ratio"].median()))
        shades.append(colors.get((kind, tower), "gray"))
    ax2.bar(
        range(len(values)),
        values,
        color=shades,
        edgecolor=["black" if "offload" in s else "none" for s in labels],
    )
    ax2.axhline(0.3, color="black", linestyle="--", linewidth=1, label="target 0.3 (video, offload)")
    ax2.set_xticks(range(len(labels)), labels, fontsize=7)
    ax2.set(ylabel="Phase-B peak / baseline peak", title=f"Phase-B memory at N = {int(m['n'].max())}")
    ax2.legend(fontsize=7)
    kinds = sorted(m["vision_workload"].unique())
    for i, kind in enumerate(kinds):
        low, high = PAPER_TABLE1.get(kind, (float("nan"),) * 2)
        ax3.plot([i - 0.15, i - 0.15], [low, high], color="black", linewidth=6, solid_capstyle="butt",
                 label="paper, Table 1 (median)" if i == 0 else None)  # fmt: skip
        # a lone median (a zero-length bar) stays visible
        ax3.plot([i - 0.15], [(low + high) / 2], "s", color="black", markersize=6)
        ours = m[m["vision_workload"] == kind]["vision_prefix_ratio"]
        ax3.plot(
            [i + 0.15] * len(ours), ours, "o", color="#2ca02c", label="ours (each cell)" if i == 0 else None
        )
    ax3.set_xticks(range(len(kinds)), [_NAMES.get(k, k) for k in kinds])
    ax3.set(xlim=(-0.6, len(kinds) - 0.4), ylim=(0.7, 1.0), ylabel="prefix ratio |P| / (|P| + |S|)",
            title="Prefix ratios: ours beside the paper's")  # fmt: skip
    ax3.legend(fontsize=7, loc="lower right")
    mark_revisions(fig, m, "multimodal")
    return [save(fig, out_dir, "multimodal")]


def multimodal_table(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """``multimodal.md`` / ``.tex``: :func:`vision_summary`, one row per cell."""
    from .tables import _write

    summary = vision_summary(df)
    if summary.empty:
        raise SkipFigure("no vision-language records (experiments/multimodal.yaml)")
    title = "Vision-language prompts: speedup, its executed-FLOP ideal, Phase-B peak over the baseline's"
    return _write(out_dir, "multimodal", summary.round(4), title)
