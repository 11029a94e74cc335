"""Figure 9 at the paper's size, modelled (``results/paper_fig9``): per split and N = 2 … 128 the speedup of
PrefixFlow's counted FLOPs and of its modelled H20 time (``harness.costmodel.roofline``) over the baseline's,
beside the paper's eager speedups. Nothing here ran on a GPU, and nothing is fit to the paper.

At one response per Phase-B microbatch every response repeats the same ops, so a step's counted FLOPs and
modelled time are affine in N (``tests/harness/test_paper_fig9.py`` shows it on a tiny model). The sweep counts
N = 2 and 4 for every split; :func:`affine_in_n` extends each (split, system) to any N through those two
cells, and where a larger N was counted as well, the table keeps the count and states how far the extension
is from it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from .common import SkipFigure, estimated, mark_revisions, save, split_label, theme

__all__ = ["PAPER_FIG9_EAGER", "FIG9_NS", "affine_in_n", "paper_fig9_table", "figure9_paper"]

# The paper's Figure 9a (eager, H20, Llama3-8B, 12,288 tokens), keyed by (prefix length, N): the values its text
# gives (§5.4). Its compiled panel is not compared: the estimate models no compiler.
PAPER_FIG9_EAGER = {(2048, 128): 1.170, (10240, 16): 3.800, (10240, 32): 4.115, (10240, 128): 4.395}
FIG9_NS = (2, 4, 8, 16, 32, 64, 128)
VALUES = ("counted_flops", "modelled_time_s")
SYSTEMS = ("baseline", "prefixflow_concat", "prefixflow")
KEY = ["model", "prefix_len", "suffix_len", "system"]


def affine_in_n(cells: pd.DataFrame, ns: Iterable[int], values: Iterable[str] = VALUES) -> pd.DataFrame:
    """Each (model, split, system)'s ``values`` at every N in ``ns``, on the line through its two smallest
    counted N: F(N) = F(n0) + (N - n0) / (n1 - n0) * (F(n1) - F(n0)); ``anchor`` marks n0 and n1. A key with
    fewer than two counted N is left out."""
    values = list(values)
    rows = []
    for key, g in cells.groupby(KEY):
        g = g.groupby("n")[values].median().sort_index()
        if len(g) < 2:
            continue
        (n0, n1), (f0, f1) = g.index[:2], (g.iloc[0], g.iloc[1])
        for n in ns:
            rows.append({**dict(zip(KEY, key, strict=True)), "n": int(n), "anchor": n in (n0, n1),
                         **{v: f0[v] + (n - n0) / (n1 - n0) * (f1[v] - f0[v]) for v in values}})  # fmt: skip
    return pd.DataFrame(rows, columns=[*KEY, "n", "anchor", *values])


def _cells(df: pd.DataFrame) -> pd.DataFrame:
    e = estimated(df)
    if e.empty or "spec" not in e.columns:
        return e.iloc[0:0]
    e = e[(e["spec"] == "paper_fig9") & e["system"].isin(SYSTEMS)]
    return e.assign(n=e["n"].astype(int), prefix_len=e["prefix_len"].astype(int),
                    suffix_len=e["suffix_len"].astype(int))  # fmt: skip


def paper_fig9_table(df: pd.DataFrame, ns: Iterable[int] = FIG9_NS) -> pd.DataFrame:
    """One row per (model, split, N): whether the N was counted (``counted``) or extended from N = 2 and 4,
    the speedup over the baseline of each PrefixFlow system's counted FLOPs (``flops_speedup_*``) and modelled
    time (``modelled_speedup_*``; ``concat``: the library's attention on a GPU, ``split``: on a CPU), the
    largest relative gap between the extension and the count over systems and values where both exist
    (``extension_gap``), and the paper's eager speedup with ours (concat, modelled) / paper."""
    cells = _cells(df)
    if cells.empty:
        return pd.DataFrame()
    ns = sorted(set(int(n) for n in ns))
    line = affine_in_n(cells, ns).set_index([*KEY, "n"])
    counted = cells.groupby([*KEY, "n"])[list(VALUES)].median()
    both = line.join(counted, suffixes=("", "_counted"), how="outer")
    gap = pd.concat([(both[f"{v}"] / both[f"{v}_counted"] - 1).abs() for v in VALUES], axis=1).max(axis=1)
    for v in VALUES:  # a count, where there is one, over the line
        both[v] = both[f"{v}_counted"].combine_first(both[v])
    checked = both["counted_flops_counted"].notna() & ~both["anchor"].fillna(True).astype(bool)
    both = both.assign(gap=gap.where(checked), is_counted=both["counted_flops_counted"].notna()).reset_index()
    rows = []
    for (model, p, s, n), g in both.groupby(["model", "prefix_len", "suffix_len", "n"]):
        g = g.set_index("system")
        if "baseline" not in g.index:
            continue
        base = g.loc["baseline"]
        row = {"model": model, "prefix_len": p, "suffix_len": s, "n": n,
               "counted": bool(g["is_counted"].all()),
               "extension_gap": g["gap"].max()}  # fmt: skip
        for sys, tag in (("prefixflow_concat", "concat"), ("prefixflow", "split")):
            if sys in g.index:
                row[f"flops_speedup_{tag}"] = base["counted_flops"] / g.loc[sys, "counted_flops"]
                row[f"modelled_speedup_{tag}"] = base["modelled_time_s"] / g.loc[sys, "modelled_time_s"]
        rows.append(row)
    out = pd.DataFrame(rows)
    out["prefix_ratio"] = out["prefix_len"] / (out["prefix_len"] + out["suffix_len"])
    out["paper_eager"] = [PAPER_FIG9_EAGER.get((p, n), np.nan) for p, n in zip(out["prefix_len"], out["n"],
                                                                                 strict=True)]  # fmt: skip
    if "modelled_speedup_concat" in out:
        out["modelled_concat/paper"] = out["modelled_speedup_concat"] / out["paper_eager"]
    out.attrs["git_rev"] = sorted(set(cells["git_rev"].dropna())) if "git_rev" in cells else []
    return out.sort_values(["model", "prefix_len", "n"]).reset_index(drop=True)


def figure9_paper(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """Speedup vs N per split: modelled time (concat attention; solid), counted FLOPs (dotted), the counted
    cells marked, and the paper's eager points (diamonds)."""
    table = paper_fig9_table(df)
    if table.empty or "modelled_speedup_concat" not in table:
        raise SkipFigure(
            "no estimated Figure 9 cells with a baseline and prefixflow_concat (results/paper_fig9)"
        )
    theme()
    splits = sorted(set(zip(table["prefix_len"], table["suffix_len"], strict=True)))
    palette = dict(zip(splits, sns.color_palette("viridis", len(splits)), strict=True))
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for (p, s), g in table.groupby(["prefix_len", "suffix_len"]):
        c = palette[(p, s)]
        ax.plot(g["n"], g["modelled_speedup_concat"], "-", color=c, label=f"{split_label(p, s)} modelled")
        ax.plot(g["n"], g["flops_speedup_concat"], ":", color=c, lw=1)
        hit = g[g["counted"]]
        ax.plot(hit["n"], hit["modelled_speedup_concat"], "o", color=c, ms=4)
        paper = g[g["paper_eager"].notna()]
        ax.scatter(paper["n"], paper["paper_eager"], marker="D", color=c, edgecolor="black", zorder=3)
    ax.scatter([], [], marker="D", color="white", edgecolor="black", label="paper, eager (H20)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ns = sorted(table["n"].unique())
    ax.set_xticks(ns, [str(int(n)) for n in ns])
    ax.set_xlabel("rollout group size N")
    ax.set_ylabel("speedup over baseline (x)")
    ax.legend(fontsize=6, title="split P/S", title_fontsize=7)
    fig.suptitle(
        "Figure 9a at the paper's size, MODELLED (not measured): Llama3-8B, 12,288 tokens, SAC, bf16\n"
        "solid: H20 roofline time, dotted: counted FLOPs, dots: counted N (others extended from N=2, 4)",
        fontsize=8,
    )
    mark_revisions(fig, pd.DataFrame({"git_rev": table.attrs.get("git_rev", [])}), "Figure 9 (paper scale)")
    return [save(fig, out_dir, "fig9a_paper_scale")]
