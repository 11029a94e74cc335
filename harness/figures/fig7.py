"""Figure 7: median per-step time of the closed GRPO loop by phase, baseline vs PrefixFlow, with the cap
from the baseline's own time split (the update eliminated, ``1/(1-f)``) and Amdahl's law at the measured
actor-update speedup ``s`` (``1/((1-f)+f/s)``) (Claim 2.1). Also the Claim-2 record selection shared by
Figure 8.

Times are medians over the warm steps (as Claim 3 takes medians over repeats): the runs step in lockstep on a
shared machine, and one load spike in one run would otherwise move a mean by more than the effect measured.
Means are kept beside them in :func:`speedups`."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from .common import SkipFigure, save, theme

PHASES = ("generation", "reward", "evaluation", "update", "sync")
PRESET_ORDER = ("paper", "cpu", "smoke", "default")
VERL_PRESET = "verl_driver"  # harness.rl.verl_driver's records: verl's engine (baseline) vs PrefixFlow's
WARMUP_STEPS = 1  # the first step of a run pays one-time allocation costs; left out of the time means


def _choice(df: pd.DataFrame) -> tuple[str, str] | None:
    """The (preset, identity) whose Claim-2 records to draw: the preferred preset present (paper > cpu >
    smoke), and within it the spec configuration with the newest record."""
    if df.empty or not {"record_kind", "preset", "identity"} <= set(df.columns):
        return None
    c2 = df[df["record_kind"].astype(str).str.startswith("rl_") & (df["status"] == "ok")]
    c2 = c2[c2["preset"].notna() & c2["identity"].notna()]
    if c2.empty:
        return None
    drawing_verl = df.attrs.get(VERL_PRESET, False)  # the verl driver's runs are drawn apart (figure7_verl)
    c2 = c2[(c2["preset"] == VERL_PRESET) == drawing_verl]
    if c2.empty:
        return None
    present = set(c2["preset"])
    preset = next((p for p in PRESET_ORDER if p in present), sorted(present)[0])
    newest = c2[c2["preset"] == preset].sort_values("timestamp")["identity"].iloc[-1]
    return preset, newest


def claim2_rows(df: pd.DataFrame, kind: str) -> pd.DataFrame:
    """Rows of one Claim-2 record kind (``rl_step``, ``rl_divergence``, ``rl_replay``, ``rl_claim3_ref``,
    ``rl_warmstart``) from one preset and spec configuration (see :func:`_choice`)."""
    choice = _choice(df)
    if choice is None:
        return df.iloc[0:0]
    preset, identity = choice
    keep = (df["record_kind"] == kind) & (df["status"] == "ok") & (df["preset"] == preset)
    return df[keep & (df["identity"] == identity)]


def step_table(df: pd.DataFrame, roles=("compare",)) -> pd.DataFrame:
    """Per-step rows of the chosen runs, sorted."""
    rows = claim2_rows(df, "rl_step")
    if rows.empty:
        return rows
    rows = rows[rows["role"].isin(roles)]
    return rows.sort_values(["run", "step"]).reset_index(drop=True)


def time_split(steps: pd.DataFrame, how: str = "median") -> pd.DataFrame:
    """Seconds per phase and per step for each system, ``how`` (median or mean) over the warm steps."""
    cols = [f"{p}_s" for p in PHASES] + ["step_s"]
    if steps.empty:
        return pd.DataFrame(columns=cols)
    warm = steps[steps["step"] > WARMUP_STEPS]
    if warm.empty:
        warm = steps
    return warm.groupby("system")[cols].agg(how)


def update_ratio(df: pd.DataFrame, fast: str, slow: str) -> float:
    """``slow``'s median actor-update time over ``fast``'s (warm steps), e.g. the tree trainer over flat."""
    split = time_split(step_table(df))
    if not {fast, slow} <= set(split.index):
        return math.nan
    return float(split.loc[slow, "update_s"] / split.loc[fast, "update_s"])


def amdahl(share: float, speedup: float) -> float:
    """Amdahl's law: the step speedup when a fraction ``share`` of the step gets ``speedup`` times faster
    (``speedup`` = inf: the cap ``1 / (1 - share)``)."""
    return 1.0 / ((1.0 - share) + share / speedup)


def speedups(df: pd.DataFrame, system: str = "prefixflow") -> dict[str, float]:
    """End-to-end and actor-update speedups (medians over warm steps; ``*_mean``: from means), the cap
    ``amdahl_bound`` = 1/(1-f), Amdahl's law at the measured update speedup ``amdahl_at_update_speedup``, the
    update's time outside ``train_group``'s phases, and the Claim-3 reference speedup; of ``system`` (e.g.
    ``prefixflow_tree``) over the baseline. Keys naming a system end in ``_baseline`` and ``_<system>``."""
    steps = step_table(df)
    split = time_split(steps)
    if not {"baseline", system} <= set(split.index):
        return {}
    b, p = split.loc["baseline"], split.loc[system]
    share = b["update_s"] / b["step_s"]
    out = {
        "update_share": share,
        "amdahl_bound": amdahl(share, math.inf),
        "e2e_speedup": b["step_s"] / p["step_s"],
        "update_speedup": b["update_s"] / p["update_s"],
    }
    out["amdahl_at_update_speedup"] = amdahl(share, out["update_speedup"])
    out["e2e_over_bound"] = out["e2e_speedup"] / out["amdahl_bound"]
    out["e2e_over_amdahl"] = out["e2e_speedup"] / out["amdahl_at_update_speedup"]
    mean = time_split(steps, "mean")
    out["e2e_speedup_mean"] = mean.loc["baseline", "step_s"] / mean.loc[system, "step_s"]
    out["update_speedup_mean"] = mean.loc["baseline", "update_s"] / mean.loc[system, "update_s"]
    if (
        "update_train_s" in steps.columns
    ):  # the update's phases alone, and what the update spends outside them
        warm = steps[steps["step"] > WARMUP_STEPS] if (steps["step"] > WARMUP_STEPS).any() else steps
        med = warm.assign(outside=warm["update_s"] - warm["update_train_s"]).groupby("system")
        med = med[["update_train_s", "outside"]].median()
        out["train_phases_speedup"] = (
            med.loc["baseline", "update_train_s"] / med.loc[system, "update_train_s"]
        )
        out["update_outside_phases_s_baseline"] = med.loc["baseline", "outside"]
        out[f"update_outside_phases_s_{system}"] = med.loc[system, "outside"]
    if "update_optimizer_s" in steps.columns:  # of which: gradient averaging, clipping and AdamW
        opt = steps[steps["step"] > WARMUP_STEPS].groupby("system")["update_optimizer_s"].median()
        out["update_optimizer_s_baseline"] = opt.get("baseline", math.nan)
        out[f"update_optimizer_s_{system}"] = opt.get(system, math.nan)
    ref = claim2_rows(df, "rl_claim3_ref")
    if not ref.empty and "step" in ref.columns:
        t = ref.pivot_table(index="step", columns="system", values="step_time_s", aggfunc="median")
        others = [s for s in t.columns if s != "baseline"]
        if "baseline" in t.columns and others:
            out["claim3_speedup"] = float((t["baseline"] / t[others[0]]).median())  # median over checkpoints
            out["claim3_suffix_len"] = float(ref["suffix_len"].median())
    return out


def verl_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The verl driver's records alone (``harness.rl.verl_driver``)."""
    rows = df.iloc[0:0] if "preset" not in df.columns else df[df["preset"] == VERL_PRESET].copy()
    rows.attrs[VERL_PRESET] = True  # read by _choice
    return rows


def figure7_verl(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """Figure 7 of the verl driver's runs: verl's timing keys as the loop's phases (gen; reward + adv;
    old_log_prob + ref; update_actor), verl's ``FSDPEngineWithLMHead`` against ``PrefixFlowFSDPEngine``."""
    rows = verl_rows(df)
    if rows.empty:
        raise SkipFigure("no verl driver records (python -m harness.rl.verl_driver)")
    return figure7(rows, out_dir, name="fig7_verl_step_breakdown", ticks=("verl engine", "PrefixFlow engine"))


def figure7(
    df: pd.DataFrame, out_dir: str | Path, name: str = "fig7_step_breakdown", ticks=("baseline", "PrefixFlow")
) -> list[Path]:
    steps = step_table(df)
    if steps.empty or not {"baseline", "prefixflow"} <= set(steps["system"]):
        raise SkipFigure("no Claim-2 closed-loop records with both trainers")
    split = time_split(steps).loc[["baseline", "prefixflow"]]
    sp = speedups(df)
    theme()
    colors = dict(zip(PHASES, sns.color_palette("Set2", len(PHASES)), strict=True))
    fig, ax = plt.subplots(figsize=(7.5, 3.3))
    y = np.arange(len(split))
    left = np.zeros(len(split))
    for phase in PHASES:
        width = split[f"{phase}_s"].to_numpy()
        ax.barh(y, width, left=left, color=colors[phase], label=phase)
        for yi, (lft, w) in enumerate(zip(left, width, strict=True)):
            if w > 0.06 * split["step_s"].max():
                ax.text(lft + w / 2, yi, f"{w:.2f}", ha="center", va="center", fontsize=7)
        left += width
    base_step = split.loc["baseline", "step_s"]
    for value, label, ls, ypos in (
        (sp["amdahl_bound"], "cap (update eliminated)", "--", 1.45),
        (sp["amdahl_at_update_speedup"], f"Amdahl at s={sp['update_speedup']:.2f}", ":", -0.45),
    ):
        ax.axvline(base_step / value, color="k", ls=ls, lw=1)
        ax.text(
            base_step / value, ypos, f" {label}: {value:.2f}x", fontsize=7, va="bottom" if ypos > 0 else "top"
        )
    ax.set_yticks(y, list(ticks))
    ax.invert_yaxis()
    ax.set_xlabel("median time per GRPO step and phase (s)")
    n_steps = int(steps["step"].max())
    extra = (
        f"; Claim-3 ref {sp['claim3_speedup']:.2f}x at S={sp['claim3_suffix_len']:g}"
        if "claim3_speedup" in sp
        else ""
    )
    ax.set_title(
        f"Figure 7: step {sp['e2e_speedup']:.2f}x, actor update {sp['update_speedup']:.2f}x{extra}\n"
        f"(update = {100 * sp['update_share']:.0f}% of the baseline step; {n_steps} steps, "
        f"{steps['model'].iloc[0]}, r={steps['prefix_ratio'].iloc[0]:.2f}, N={int(steps['n'].iloc[0])})",
        fontsize=8,
    )
    ax.legend(fontsize=7, ncol=len(PHASES), loc="upper center", bbox_to_anchor=(0.5, -0.28), frameon=False)
    return [save(fig, out_dir, name)]
