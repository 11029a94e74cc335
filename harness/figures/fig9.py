"""Figure 9: PrefixFlow speedup over the baseline vs N, one line per prefix ratio, with the ideal model.

(a) eager (``compile`` false on both sides), (b) compiled (``compile`` true on both sides). The system
``prefixflow`` is the library default (its resolved attention variant is in the title); ``_concat``/``_split``
pin one. The dashed line is the corrected ideal of ``harness.costmodel.flops`` (what the schedule must execute).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from .common import (
    SkipFigure,
    flag,
    mark_revisions,
    pair_speedups,
    restrict_to_mode,
    save,
    split_label,
    theme,
)


def _speedups(df: pd.DataFrame, compiled: bool, system: str) -> pd.DataFrame:
    if "spec" in df.columns and (df["spec"] == "claim3").any():
        df = df[df["spec"] == "claim3"]  # Figure 9 is Claim 3's sweep when it is present
    sp = pair_speedups(df, systems=(system,))
    if sp.empty:
        return sp
    sp = sp[(flag(sp, "compile") == compiled) & ~flag(sp, "offload")]
    # one model/dtype/layout/microbatch/total length per panel: the most common one
    sp = sp.assign(total=sp["prefix_len"] + sp["suffix_len"])
    return restrict_to_mode(sp, ["spec", "model", "dtype", "device", "layout", "microbatch", "ac", "total"])


def figure9(
    df: pd.DataFrame, out_dir: str | Path, compiled: bool = False, system: str = "prefixflow"
) -> list[Path]:
    """Speedup of ``system`` vs N per prefix ratio (measured points, solid) and ``ideal_speedup`` (dashed)."""
    tag = "compiled" if compiled else "eager"
    sp = _speedups(df, compiled, system)
    if sp.empty:
        raise SkipFigure(f"no {tag} baseline/{system} pairs")
    theme()
    sp = sp.sort_values(["prefix_ratio", "n"])
    ratios = sorted(sp["prefix_ratio"].round(4).unique())
    palette = dict(zip(ratios, sns.color_palette("viridis", len(ratios)), strict=True))
    fig, ax = plt.subplots(figsize=(6.0, 4.2))
    for r, g in sp.groupby(sp["prefix_ratio"].round(4)):
        color = palette[r]
        label = f"r={r:.2f} ({split_label(g['prefix_len'].iloc[0], g['suffix_len'].iloc[0])})"
        ax.plot(g["n"], g["speedup"], "o-", color=color, label=label)
        if "ideal_speedup" in g.columns and g["ideal_speedup"].notna().any():
            ax.plot(g["n"], g["ideal_speedup"], "--", color=color, alpha=0.7, lw=1)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ns = sorted(sp["n"].unique())
    ax.set_xticks(ns, [str(int(n)) for n in ns])
    ax.set_xlabel("rollout group size N")
    ax.set_ylabel("speedup over baseline (x)")
    model = sp["model"].iloc[0] if "model" in sp.columns else ""
    resolved = sp["attention"].dropna().unique() if "attention" in sp.columns else []
    variant = f" [{system}" + (f", {'/'.join(map(str, resolved))} attention" if len(resolved) else "") + "]"
    ax.set_title(
        f"Figure 9{'b' if compiled else 'a'}: {tag} speedup{variant}\n({model}; dashed = ideal)", fontsize=9
    )
    ax.legend(title="prefix ratio (P/S)", fontsize=7)
    mark_revisions(fig, sp, f"Figure 9{'b' if compiled else 'a'}")
    suffix = "" if system == "prefixflow" else f"_{system}"
    return [save(fig, out_dir, f"fig9{'b' if compiled else 'a'}_speedup_{tag}{suffix}")]


def figure9a(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    return figure9(df, out_dir, compiled=False)


def figure9b(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    return figure9(df, out_dir, compiled=True)


def figure9a_split(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """Figure 9a for PrefixFlow pinned to split attention."""
    return figure9(df, out_dir, compiled=False, system="prefixflow_split")


def figure9a_concat(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """Figure 9a for PrefixFlow pinned to concat attention (the library's default on GPU)."""
    return figure9(df, out_dir, compiled=False, system="prefixflow_concat")
