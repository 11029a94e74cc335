"""Smoke overview: step time and peak memory per cell, one bar per system."""

from __future__ import annotations

import logging
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from .common import SkipFigure, flag, measured, mem_unit, save, split_label, theme, variant

log = logging.getLogger(__name__)
MAX_CELLS = 24


def cell_labels(df: pd.DataFrame) -> pd.Series:
    """A short label per record: ``P/S N=n`` plus layout, ``b=`` and ``compiled`` where set."""
    parts = [df.apply(lambda r: f"{split_label(r.prefix_len, r.suffix_len)} N={int(r.n)}", axis=1)]
    if "layout" in df.columns:
        parts.append(" " + df["layout"].fillna("").astype(str))
    if "microbatch" in df.columns:
        parts.append(df["microbatch"].map(lambda b: f" b={int(b)}" if pd.notna(b) else ""))
    parts.append(pd.Series(np.where(flag(df, "compile"), " compiled", ""), index=df.index))
    label = parts[0]
    for p in parts[1:]:
        label = label + p
    return label.str.strip()


def smoke_overview(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    m = measured(df)
    if m.empty or not {"prefix_len", "suffix_len", "n", "step_time_s"} <= set(m.columns):
        raise SkipFigure("no successful measured records")
    m = m.assign(cell=cell_labels(m), variant=variant(m))
    sort_cols = [c for c in ("compile", "prefix_len", "suffix_len", "n", "layout", "microbatch") if c in m]
    m = m.assign(compile=flag(m, "compile")) if "compile" in m.columns else m
    cells = list(dict.fromkeys(m.sort_values(sort_cols, na_position="first")["cell"]))
    if len(cells) > MAX_CELLS:
        log.info("smoke overview: showing the first %d of %d cells", MAX_CELLS, len(cells))
        cells = cells[:MAX_CELLS]
        m = m[m["cell"].isin(cells)]
    theme()
    variants = sorted(m["variant"].unique(), key=lambda v: (v != "baseline", v))
    width = 0.8 / len(variants)
    peak_col = "peak_mem_bytes" if "peak_mem_bytes" in m.columns else None
    fig, axes = plt.subplots(1, 2 if peak_col else 1, figsize=(10.0, 0.35 * len(cells) + 2.2), squeeze=False)
    x = np.arange(len(cells))
    scale, unit = mem_unit(m[peak_col].dropna()) if peak_col else (1, "")
    for i, v in enumerate(variants):
        g = m[m["variant"] == v].groupby("cell")
        off = (i - (len(variants) - 1) / 2) * width
        t = g["step_time_s"].median().reindex(cells)
        axes[0, 0].barh(x + off, t.values, width, label=v)
        if peak_col:
            axes[0, 1].barh(x + off, g[peak_col].median().reindex(cells).values / scale, width, label=v)
    axes[0, 0].set_xlabel("step time (s, median)")
    axes[0, 0].set_yticks(x, cells, fontsize=7)
    axes[0, 0].invert_yaxis()
    axes[0, 0].legend(fontsize=7)
    if peak_col:
        axes[0, 1].set_xlabel(f"peak memory ({unit})")
        axes[0, 1].set_yticks(x, [""] * len(cells))
        axes[0, 1].invert_yaxis()
    fig.suptitle("Smoke overview: baseline vs PrefixFlow per cell")
    return [save(fig, out_dir, "smoke_overview")]
