"""Figure 6: (a) CP Phase-B decomposition, on demand vs prefetch; (b) PP barrier minus stage-local step time.

Measured panels come from the cells of ``experiments/claim1_cp_pp.yaml`` (systems ``prefixflow`` = prefetch
/ stage-local, ``prefixflow_cp_demand`` and ``prefixflow_pp_barrier``); simulated panels from the records that
``pf-bench simulate`` writes (``source == "simulated"``, paper-scale shapes), each titled as simulated. A third
figure compares the simulator's predictions with the measured points it was checked against.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from .common import SkipFigure, as_key, measured, save, theme

CP_MODES = {"prefixflow_cp_demand": "on demand", "prefixflow": "prefetch"}
PP_MODES = {"prefixflow_pp_barrier": "barrier", "prefixflow": "stage-local"}
_CONFIG = ["spec", "model", "model_overrides", "dtype", "device", "prefix_len", "suffix_len", "layout",
           "microbatch", "ac", "tp", "cp", "pp", "dp"]  # fmt: skip


def _source(df: pd.DataFrame, name: str) -> pd.DataFrame:
    if "source" not in df.columns:
        return df.iloc[0:0]
    return df[(df["status"] == "ok") & (df["source"] == name)]


def _config_key(df: pd.DataFrame) -> pd.Series:
    cols = [c for c in _CONFIG if c in df.columns]
    return (
        df[cols].apply(lambda r: json.dumps([str(v) for v in r]), axis=1)
        if len(df)
        else pd.Series([], dtype=object)
    )


def _title(row: pd.Series, simulated: bool) -> str:
    par = ", ".join(f"{d.upper()}={int(row[d])}" for d in ("pp", "tp", "cp") if d in row and int(row[d]) > 1)
    where = "simulated" if simulated else f"measured ({row.get('device', '')})"
    return f"{where}: {row['model']}, {par}, P={int(row['prefix_len'])}, S={int(row['suffix_len'])}"


def cp_breakdown(df: pd.DataFrame) -> pd.DataFrame:
    """Median Phase-B decomposition per (panel, mode): compute (minus overlapped), overlapped and exposed
    prefix-K/V communication, sequence-exchange communication, gather counts, rank spread."""
    rows = []
    for simulated, part in ((False, measured(df)), (True, _source(df, "simulated"))):
        if part.empty or "cp_exposed_s" not in part.columns or "cp" not in part.columns:
            continue
        part = part[(part["cp"] > 1) & part["system"].isin(CP_MODES) & part["cp_exposed_s"].notna()]
        if "pp" in part.columns:
            part = part[part["pp"] == 1]
        part = part.assign(_key=_config_key(part), _n=as_key(part["n"]))
        for (_, n), g in part.groupby(["_key", "_n"]):
            if g["system"].nunique() < 2:
                continue  # a panel compares the two modes side by side
            for system, s in g.groupby("system"):
                med = s[[c for c in s.columns if c.startswith("cp_") or c == "phase_b_s"]].median(
                    numeric_only=True
                )
                seq = float(med.get("cp_sequence_phase_b_s", 0.0) or 0.0)
                exposed, overlapped = (
                    float(med["cp_exposed_s"]),
                    float(med.get("cp_overlapped_s", 0.0) or 0.0),
                )
                compute = float(med["phase_b_s"]) - exposed - seq
                rows.append(
                    dict(
                        panel=_title(s.iloc[0], simulated) + f", N={n}",
                        simulated=simulated,
                        mode=CP_MODES[system],
                        phase_b_s=float(med["phase_b_s"]),
                        compute_s=max(compute - overlapped, 0.0),
                        overlapped_s=min(overlapped, max(compute, 0.0)),
                        exposed_s=exposed,
                        sequence_s=seq,
                        demand_gathers=float(med.get("cp_demand_gathers", float("nan"))),
                        prefetched_gathers=float(med.get("cp_prefetched_gathers", float("nan"))),
                        spread_s=float(med.get("cp_phase_b_spread_s", float("nan"))),
                    )
                )
    return pd.DataFrame(rows)


def figure6a(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """Stacked Phase-B bars (compute, overlapped comm, exposed comm, sequence exchange) per mode and panel."""
    table = cp_breakdown(df)
    if table.empty:
        raise SkipFigure("no CP records with both prefixflow (prefetch) and prefixflow_cp_demand")
    theme()
    panels = list(dict.fromkeys(table.sort_values("simulated")["panel"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.4), squeeze=False)
    parts = [("compute_s", "compute", "#4c72b0"), ("overlapped_s", "overlapped comm", "#8fb1e0"),
             ("exposed_s", "exposed comm (prefix K/V)", "#c44e52"), ("sequence_s", "sequence K/V exchange", "#999999")]  # fmt: skip
    for ax, panel in zip(axes[0], panels, strict=True):
        t = (
            table[table["panel"] == panel]
            .set_index("mode")
            .reindex(["on demand", "prefetch"])
            .dropna(how="all")
        )
        bottom = [0.0] * len(t)
        for col, label, color in parts:
            ax.bar(t.index, t[col], bottom=bottom, label=label, color=color, width=0.6)
            bottom = [b + v for b, v in zip(bottom, t[col], strict=True)]
        for i, (_, r) in enumerate(t.iterrows()):
            ax.text(i, bottom[i], f"demand {r['demand_gathers']:.0f}\nprefetched {r['prefetched_gathers']:.0f}",
                    ha="center", va="bottom", fontsize=7)  # fmt: skip
        ax.set_ylim(0, max(bottom) * 1.25)
        ax.set_title(panel, fontsize=8)
        ax.set_ylabel("Phase B per rank (s)")
    # below the axes: inside, it covered the bars
    axes[0][0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.1), ncol=2)
    fig.suptitle("Figure 6a: CP Phase B, on-demand vs prefetched prefix K/V gathers", fontsize=10)
    return [save(fig, out_dir, "fig6a_cp_prefetch")]


def pp_gaps(df: pd.DataFrame) -> pd.DataFrame:
    """Per (panel, N): median stage-local and barrier step times, their difference and (measured) the
    quartiles of the paired per-step differences."""
    rows = []
    for simulated, part in ((False, measured(df)), (True, _source(df, "simulated"))):
        if part.empty or "pp" not in part.columns:
            continue
        part = part[(part["pp"] > 1) & part["system"].isin(PP_MODES) & part["step_time_s"].notna()]
        part = part.assign(_key=_config_key(part))
        for _, g in part.groupby("_key"):
            steps = g.groupby(["n", "system"])["step_time_s"].median().unstack()
            if not set(PP_MODES) <= set(steps.columns):
                continue
            title = _title(g.iloc[0], simulated)
            for n, r in steps.dropna().iterrows():
                local, barrier = float(r["prefixflow"]), float(r["prefixflow_pp_barrier"])
                lo, hi = _paired_spread(g[g["n"] == n])
                rows.append(dict(panel=title, simulated=simulated, pp=int(g["pp"].iloc[0]), n=int(n),
                                 stage_local_s=local, barrier_s=barrier, gap_s=barrier - local,
                                 gap_q25_s=lo, gap_q75_s=hi))  # fmt: skip
    return pd.DataFrame(rows)


def _paired_spread(g: pd.DataFrame) -> tuple[float, float]:
    """Quartiles of barrier − stage-local over the timed steps, paired in the order they ran (the systems
    alternate step by step), from each step's stage timelines (``pp_timelines_steps``); NaN without them."""
    spans = {}
    for system in PP_MODES:
        rec = g[g["system"] == system]
        raw = rec["pp_timelines_steps"].iloc[0] if "pp_timelines_steps" in rec and len(rec) else None
        if not isinstance(raw, str):
            return math.nan, math.nan
        spans[system] = [max(e["end"] for ev in json.loads(t) for e in ev) for t in json.loads(raw) if t]
    diffs = [b - a for a, b in zip(spans["prefixflow"], spans["prefixflow_pp_barrier"], strict=False)]
    if len(diffs) < 2:
        return math.nan, math.nan
    q = statistics.quantiles(diffs, n=4)
    return q[0], q[2]


def figure6b(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """Barrier minus stage-local step time against N, one panel per pipeline configuration."""
    table = pp_gaps(df)
    if table.empty:
        raise SkipFigure("no PP records with both prefixflow (stage-local) and prefixflow_pp_barrier")
    theme()
    panels = list(dict.fromkeys(table.sort_values(["simulated", "pp", "panel"])["panel"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        t = table[table["panel"] == panel].sort_values("n")
        ax.plot(t["n"], t["gap_s"], marker="o", color="#c44e52", label="barrier − stage-local")
        if t["gap_q25_s"].notna().any():  # measured: the paired per-step gaps' quartiles
            ax.vlines(t["n"], t["gap_q25_s"], t["gap_q75_s"], color="#c44e52", alpha=0.5, lw=3)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N (responses per group)")
        ax.set_ylabel("step-time gap (s)")
        lo = min(t["gap_s"].min(), t["gap_q25_s"].min(skipna=True) if t["gap_q25_s"].notna().any() else 0.0)
        hi = max(t["gap_s"].max(), t["gap_q75_s"].max(skipna=True) if t["gap_q75_s"].notna().any() else 0.0)
        ax.set_ylim(min(lo * 1.3, 0.0), max(hi * 1.3, 1e-6))  # noise can be < 0
        ax.axhline(0, color="k", lw=0.6)
        twin = ax.twinx()
        twin.plot(t["n"], t["stage_local_s"], ls="--", color="#4c72b0", label="stage-local step")
        twin.set_ylabel("stage-local step (s)", color="#4c72b0")
        twin.grid(False)
        ax.set_title(panel, fontsize=8)
    handles = axes[0][0].get_legend_handles_labels()[0] + [
        plt.Line2D([], [], color="#c44e52", alpha=0.5, lw=3),
        plt.Line2D([], [], ls="--", color="#4c72b0"),
    ]
    labels = [
        "barrier − stage-local (median)",
        "paired per-step gaps, quartiles",
        "stage-local step (right axis)",
    ]
    axes[0][0].legend(handles, labels, fontsize=7, loc="upper left")
    fig.suptitle("Figure 6b: PP global barrier minus stage-local phase switching", fontsize=10)
    return [save(fig, out_dir, "fig6b_pp_switching")]


def simulator_validation(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """Predicted against measured (step time or Phase B) for every point the simulator was checked against."""
    v = _source(df, "simulator-validation")
    if v.empty:
        raise SkipFigure("no simulator-validation records (pf-bench simulate --validate)")
    theme()
    fig, ax = plt.subplots(figsize=(4.4, 4.0))
    for quantity, g in v.groupby("quantity"):
        ax.scatter(g["measured_s"], g["predicted_s"], label=str(quantity), s=18)
    top = float(max(v["measured_s"].max(), v["predicted_s"].max())) * 1.1
    ax.plot([0, top], [0, top], color="k", lw=0.8)
    ax.fill_between([0, top], [0, 0.85 * top], [0, 1.15 * top], color="k", alpha=0.08, label="±15%")
    ax.set_xlabel("measured (s)")
    ax.set_ylabel("simulated (s)")
    ax.set_title(f"simulator vs measured: worst error {v['sim_error'].max():.1%}", fontsize=9)
    ax.legend(fontsize=7)
    return [save(fig, out_dir, "fig6_simulator_validation")]
