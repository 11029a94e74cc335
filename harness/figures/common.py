"""Shared helpers for figures and tables: record selection, speedup pairing, saving."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import logging  # noqa: E402

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

ESTIMATE_METER = "fake-live-bytes"  # harness.records.ESTIMATE_METER (records sit above figures)
GIB = 1024**3
MIB = 1024**2

# Columns that identify a configuration (a cell) apart from the system. `offload` is left out: the
# baseline cannot offload, so a PrefixFlow(+offload) record pairs with the baseline of its cell.
CONFIG_COLUMNS = (
    "spec", "model", "model_overrides", "dtype", "device", "prefix_len", "suffix_len", "n",
    "suffix_spread", "layout", "microbatch", "microbatch_auto", "memory_budget", "compile", "ac", "tp", "cp",
    "pp", "dp", "ep", "world_size", "dp_replicate", "dp_shard", "groups_per_step", "parallel_layout",
)  # fmt: skip


log = logging.getLogger("harness.figures")


class SkipFigure(Exception):
    """Raised by a figure function when the records it needs are absent; the message says why."""


def revisions(df: pd.DataFrame) -> list[str]:
    """The git revisions the records were measured at (``git_rev``, comma-joined lists allowed)."""
    if "git_rev" not in df.columns or df.empty:
        return []
    revs = {r for v in df["git_rev"].dropna().astype(str) for r in v.split(",") if r}
    return sorted(revs)


def revision_warning(df: pd.DataFrame, what: str) -> str | None:
    """A warning (also logged) when ``df``'s records come from more than one git revision (or from a working
    tree with uncommitted changes), else None: numbers measured at different revisions may not compare."""
    revs = revisions(df)
    dirty = [r for r in revs if r.endswith("-dirty")]
    if len(revs) <= 1 and not dirty:
        return None
    text = f"{what}: records from {len(revs)} git revisions ({', '.join(revs)})"
    if dirty:
        text += "; uncommitted changes in " + ", ".join(dirty)
    log.warning("%s", text)
    return text


def mark_revisions(fig, df: pd.DataFrame, what: str) -> None:
    """Print :func:`revision_warning` at the foot of ``fig`` when the records mix revisions."""
    text = revision_warning(df, what)
    if text:
        fig.text(0.01, 0.005, "WARNING: " + text, fontsize=6, color="#b00000", ha="left", va="bottom")


_FALSE_STRINGS = {"", "none", "off", "false", "no", "0", "nan"}


def _truthy(v) -> bool:
    if v is None:
        return False
    if isinstance(v, str):
        return v.strip().lower() not in _FALSE_STRINGS  # e.g. an offload tier name such as "mmap"
    if isinstance(v, float | np.floating):
        return bool(v) and not np.isnan(v)
    return bool(v)


def flag(df: pd.DataFrame, col: str) -> pd.Series:
    """A boolean view of a flag column: missing values (or a missing column), "none"/"off" read False."""
    if col not in df.columns:
        return pd.Series(False, index=df.index)
    return df[col].map(_truthy).astype(bool)


def frontier_mask(df: pd.DataFrame) -> pd.Series:
    """Rows that are capacity-frontier probes (they carry a memory budget)."""
    if "budget_bytes" in df.columns:
        return df["budget_bytes"].notna()
    if "probe" in df.columns:
        return df["probe"].notna()
    return pd.Series(False, index=df.index)


def measured(df: pd.DataFrame) -> pd.DataFrame:
    """Successful sweep-cell records that were measured: no capacity-frontier probes, no ``pf-bench simulate``
    rows, no rows of another kind (``record_kind`` set: e.g. Claim 2's closed-loop steps; ``workload`` set:
    tree cells), which their own figures read."""
    if df.empty or "status" not in df.columns:
        return df.iloc[0:0]
    ok = (df["status"] == "ok") & ~frontier_mask(df)
    if "source" in df.columns:
        ok &= ~df["source"].isin(["simulated", "simulator-validation"])
    if "record_kind" in df.columns:
        ok &= df["record_kind"].isna()
    if "workload" in df.columns:  # tree cells: their own figures (harness.figures.trees)
        ok &= df["workload"].isna()
    if "vision_workload" in df.columns:  # vision cells: their own figure (harness.figures.multimodal)
        ok &= df["vision_workload"].isna()
    if "mem_meter" in df.columns:  # estimates (nothing ran): their own figures (harness.figures.paper_scale)
        ok &= df["mem_meter"] != ESTIMATE_METER
    return df[ok]


def estimated(df: pd.DataFrame) -> pd.DataFrame:
    """Successful estimate records (``mem_meter = fake-live-bytes``: fake tensors, nothing ran)."""
    if df.empty or "status" not in df.columns or "mem_meter" not in df.columns:
        return df.iloc[0:0]
    return df[(df["status"] == "ok") & (df["mem_meter"] == ESTIMATE_METER) & ~frontier_mask(df)]


def variant(df: pd.DataFrame) -> pd.Series:
    """``system`` with ``+offload`` appended where the record ran with offload."""
    return df["system"].astype(str) + np.where(flag(df, "offload"), "+offload", "")


def prefix_ratio(df: pd.DataFrame) -> pd.Series:
    if "prefix_ratio" in df.columns and df["prefix_ratio"].notna().all():
        return df["prefix_ratio"].astype(float)
    return df["prefix_len"] / (df["prefix_len"] + df["suffix_len"])


def as_key(series: pd.Series) -> pd.Series:
    """Values as plain strings, missing ones included (pandas 3's ``astype(str)`` keeps NaN as NaN)."""
    return series.map(str).astype(object)


def restrict_to_mode(df: pd.DataFrame, cols) -> pd.DataFrame:
    """Keep the rows holding the most common value of each present column, in order (NaN counts)."""
    for col in cols:
        if col in df.columns and not df.empty:
            key = as_key(df[col])
            df = df[key == key.value_counts().idxmax()]
    return df


def _keys(df: pd.DataFrame) -> list[str]:
    return [c for c in CONFIG_COLUMNS if c in df.columns]


def pair_speedups(df: pd.DataFrame, systems=("prefixflow",)) -> pd.DataFrame:
    """Speedup of each system over the baseline of the same configuration.

    Records are matched on every config column except ``system`` (and ``offload``, which only the
    non-baseline side can have). Repeated measurements of one configuration are reduced by the median.
    Returns one row per (configuration, system, offload) with ``baseline_s``, ``system_s``, ``speedup``
    and, where present, ``ideal_speedup``.
    """
    m = measured(df)
    if m.empty or "system" not in m.columns:
        return pd.DataFrame()
    keys = _keys(m)
    m = m.assign(_offload=flag(m, "offload"))
    # groupby drops NaN keys, so compare configurations through their string form
    skeys = [f"_k_{c}" for c in keys]
    m = m.assign(**{sk: as_key(m[c]) for sk, c in zip(skeys, keys, strict=True)})
    other = m[m["system"].isin(systems)]
    if not (m["system"] == "baseline").any() or other.empty:
        return pd.DataFrame()
    agg = {"step_time_s": "median", **{c: "first" for c in keys}}
    for col in (
        "ideal_speedup", "paper_ideal_speedup", "phase_a_s", "phase_b_s", "phase_c_s", "peak_mem_bytes",
        "peak_mem_phase_b_bytes", "prefix_ratio", "model_flops", "counted_flops",
    ):  # fmt: skip
        if col in other.columns:
            agg[col] = "median"
    if "attention" in other.columns:
        agg["attention"] = "first"
    if "git_rev" in m.columns:
        agg["git_rev"] = _join
    sys_rows = other.groupby([*skeys, "system", "_offload"], dropna=False).agg(agg).reset_index()
    sys_rows = sys_rows.rename(columns={"step_time_s": "system_s", "_offload": "offload"})
    base_cols = {"baseline_s": ("step_time_s", "median")}
    if "peak_mem_bytes" in m.columns:
        base_cols["baseline_peak_bytes"] = ("peak_mem_bytes", "median")
    if "git_rev" in m.columns:
        base_cols["baseline_git_rev"] = ("git_rev", _join)
    base = m[m["system"] == "baseline"].groupby(skeys, dropna=False).agg(**base_cols).reset_index()
    out = sys_rows.merge(base, on=skeys, how="inner").drop(columns=skeys)
    if "git_rev" in out.columns:
        out["git_rev"] = [
            _join(pd.Series([a, b])) for a, b in zip(out["git_rev"], out["baseline_git_rev"], strict=True)
        ]
        out = out.drop(columns="baseline_git_rev")
    out["speedup"] = out["baseline_s"] / out["system_s"]
    out["prefix_ratio"] = prefix_ratio(out)
    return out.reset_index(drop=True)


def _join(values: pd.Series) -> str:
    """Distinct non-empty values, sorted and comma-joined (for ``git_rev``)."""
    return ",".join(sorted({r for v in values.dropna().astype(str) for r in v.split(",") if r}))


def theme() -> None:
    sns.set_theme(style="whitegrid", context="paper")


def mem_unit(values) -> tuple[float, str]:
    """GiB when the largest value reaches 1 GiB, else MiB."""
    top = np.nanmax(np.asarray(values, dtype=float)) if len(values) else 0.0
    return (GIB, "GiB") if top >= GIB else (MIB, "MiB")


def save(fig, out_dir: str | Path, name: str) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def split_label(prefix_len, suffix_len) -> str:
    return f"{int(prefix_len)}/{int(suffix_len)}"
