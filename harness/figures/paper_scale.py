"""Figure 10a at the paper's size: estimated Phase-B peaks (``results/paper_scale``) beside the paper's.

The paper (§5.5, Figure 10a; Llama3-8B, TP2×CP4, 12,288 tokens, default SAC, PrefixFlow with offload, rank-max
CUDA-allocated HBM) gives the baseline's Phase-B peak as one value, 64.7 GiB, and PrefixFlow's as four: 51.6,
39.0, 32.8 and 26.5 GiB "as the split moves from 2k/10k to 10k/2k". It names only the ends. Under a peak that
falls linearly with the prefix ratio, each step is proportional to the split spacing; the paper's steps are
12.6, 6.2 and 6.3 GiB, one twice the others, which fits prefixes of 2k, 6k, 8k and 10k (spacings 4k, 2k, 2k).
So 39.0 is matched to 6k/6k and 32.8 to 8k/4k, and 4k/8k has no paper value.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from .common import GIB, SkipFigure, estimated, mark_revisions, save, split_label, theme
from .fig10 import COLORS, fixed_total_peaks

__all__ = ["PAPER_FIG10A_GIB", "PAPER_BASELINE_GIB", "paper_scale_table", "figure10a_paper"]

PAPER_BASELINE_GIB = 64.7
PAPER_FIG10A_GIB = {2048: 51.6, 6144: 39.0, 8192: 32.8, 10240: 26.5}  # prefix length -> PrefixFlow + offload


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
