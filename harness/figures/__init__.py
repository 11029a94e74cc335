"""Every paper figure and table as a pure function of the collected records DataFrame.

Each figure function takes ``(df, out_dir)``, writes PNG files and returns their paths, or raises
:class:`SkipFigure` with the reason when its records are absent. :func:`render_all` and
:func:`render_tables` run them all, log what they skipped and return what they wrote.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from .common import SkipFigure
from .fig6 import figure6a, figure6b, simulator_validation
from .fig7 import figure7, figure7_verl
from .fig8 import claim2_table, figure8a, figure8a_verl, figure8b
from .fig9 import figure9a, figure9a_concat, figure9a_split, figure9b
from .fig10 import figure10a, figure10b, frontier_table
from .fig11 import figure11
from .multimodal import figure_multimodal, multimodal_table
from .paper_fig9 import figure9_paper
from .paper_scale import figure10a_paper, figure10b_paper, figure11_paper
from .smoke import smoke_overview
from .tables import alignment_table, peer_table, speedup_table
from .trees import tree_speedup, tree_tables, tree_time_memory

# frontier_table stays importable from here: docs/claim4.md and notebooks/capacity_frontier.ipynb use it.
__all__ = ["FIGURES", "frontier_table", "render_all", "render_tables"]

log = logging.getLogger(__name__)

FIGURES: dict[str, Callable[[pd.DataFrame, Path], list[Path]]] = {
    "fig6a": figure6a,
    "fig6b": figure6b,
    "fig6_sim": simulator_validation,
    "fig7": figure7,
    "fig8a": figure8a,
    "fig8b": figure8b,
    "fig7_verl": figure7_verl,
    "fig8a_verl": figure8a_verl,
    "claim2_summary": claim2_table,
    "fig9a": figure9a,
    "fig9a_concat": figure9a_concat,
    "fig9a_split": figure9a_split,
    "fig9b": figure9b,
    "fig10a": figure10a,
    "fig9a_paper": figure9_paper,
    "fig10a_paper": figure10a_paper,
    "fig10b_paper": figure10b_paper,
    "fig11_paper": figure11_paper,
    "fig10b": figure10b,
    "fig11": figure11,
    "smoke": smoke_overview,
    "trees_speedup": tree_speedup,
    "trees_time_memory": tree_time_memory,
    "multimodal": figure_multimodal,
}


def _run(name: str, fn, *args) -> list[Path]:
    try:
        return fn(*args)
    except SkipFigure as why:
        log.info("skip %s: %s", name, why)
        return []


def render_all(df: pd.DataFrame, out_dir: str | Path, only: list[str] | None = None) -> list[Path]:
    """Render every figure whose records are present (or the names in ``only``); return the PNG paths."""
    unknown = set(only or ()) - set(FIGURES)
    if unknown:
        raise ValueError(f"unknown figures {sorted(unknown)}; known: {sorted(FIGURES)}")
    paths: list[Path] = []
    for name, fn in FIGURES.items():
        if only is None or name in only:
            paths += _run(name, fn, df, Path(out_dir))
    return paths


def render_tables(df: pd.DataFrame, out_dir: str | Path, alignment=None) -> list[Path]:
    """Write the speedup table, the PrefixGrouper table and, given ``alignment`` (DataFrame, file or folder),
    Table 3."""
    paths = _run("speedup table", speedup_table, df, Path(out_dir))
    paths += _run("PrefixGrouper table", peer_table, df, Path(out_dir))
    paths += _run("tree tables", tree_tables, df, Path(out_dir))
    paths += _run("multimodal table", multimodal_table, df, Path(out_dir))
    if alignment is None:
        log.info("skip table3: no alignment records given")
    else:
        paths += _run("table3", alignment_table, alignment, Path(out_dir))
    return paths
