"""Tables: the speedup table (markdown + LaTeX) and Table 3 (multi-step G/L/W alignment)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from .common import CONFIG_COLUMNS, MIB, SkipFigure, as_key, flag, measured, pair_speedups, revision_warning

ALIGN_QUANTITIES = ("G", "L", "W")


def _cell(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v != v:
            return "-"
        return f"{v:.3g}" if abs(v) < 1e-2 and v != 0 else f"{v:.3f}"
    return str(v)


def to_markdown(df: pd.DataFrame) -> str:
    """A GitHub markdown table (no external dependency)."""
    head = "| " + " | ".join(map(str, df.columns)) + " |"
    sep = "| " + " | ".join("---" for _ in df.columns) + " |"
    rows = ["| " + " | ".join(_cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join([head, sep, *rows]) + "\n"


def _tex(s: str) -> str:
    for a, b in (("\\", r"\textbackslash{}"), ("_", r"\_"), ("%", r"\%"), ("&", r"\&"), ("#", r"\#")):
        s = s.replace(a, b)
    return s


def to_latex(df: pd.DataFrame, caption: str, label: str) -> str:
    """A booktabs ``table`` environment."""
    cols = "l" * len(df.columns)
    lines = [
        r"\begin{table}[t]", r"\centering", rf"\caption{{{_tex(caption)}}}", rf"\label{{{label}}}",
        rf"\begin{{tabular}}{{{cols}}}", r"\toprule",
        " & ".join(_tex(str(c)) for c in df.columns) + r" \\", r"\midrule",
    ]  # fmt: skip
    lines += [" & ".join(_tex(_cell(v)) for v in row) + r" \\" for row in df.itertuples(index=False)]
    lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    return "\n".join(lines) + "\n"


def _write(out_dir: str | Path, name: str, table: pd.DataFrame, caption: str) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md, tex = out / f"{name}.md", out / f"{name}.tex"
    md.write_text(f"**{caption}**\n\n" + to_markdown(table))
    tex.write_text(to_latex(table, caption, f"tab:{name}"))
    return [md, tex]


SPEEDUP_SYSTEMS = ("prefixflow", "prefixflow_concat", "prefixflow_split", "prefix_grouper")


def speedup_frame(df: pd.DataFrame) -> pd.DataFrame:
    """One row per paired configuration and non-baseline system, sorted for reading.

    ``ideal``: the corrected ideal (``harness.costmodel.flops.ideal_speedup``), ``of ideal`` = speedup / ideal;
    ``paper ideal``: the paper's §3.1 model. Memory compares like with like: ``peak ÷ base`` is the system's
    whole-step peak over the baseline's whole-step peak; ``B peak MiB`` is PrefixFlow's Phase-B peak (its
    own scope; the baseline and PrefixGrouper have no Phase B).
    """
    sp = pair_speedups(df, systems=SPEEDUP_SYSTEMS)
    if sp.empty:
        return sp
    sp = sp.assign(compile=flag(sp, "compile"), offload=flag(sp, "offload"))
    if "parallel_layout" in sp.columns:  # records from before parallel layouts ran on one process
        sp["parallel_layout"] = sp["parallel_layout"].fillna("single")
    if "peak_mem_bytes" in sp.columns:
        sp["peak_mib"] = sp["peak_mem_bytes"] / MIB
        if "baseline_peak_bytes" in sp.columns:
            sp["peak_ratio"] = sp["peak_mem_bytes"] / sp["baseline_peak_bytes"]
    if "peak_mem_phase_b_bytes" in sp.columns:
        is_pf = sp["system"].astype(str).str.startswith("prefixflow")
        sp["b_peak_mib"] = (sp["peak_mem_phase_b_bytes"] / MIB).where(is_pf)
    cols = {
        "model": "model", "parallel_layout": "parallel", "groups_per_step": "groups",
        "system": "system", "attention": "attention", "compile": "compiled",
        "offload": "offload", "layout": "layout", "prefix_len": "P", "suffix_len": "S", "prefix_ratio": "r", "n": "N",
        "microbatch": "microbatch", "baseline_s": "baseline s", "system_s": "system s", "speedup": "speedup", "ideal_speedup": "ideal",
        "paper_ideal_speedup": "paper ideal", "peak_mib": "peak MiB", "peak_ratio": "peak ÷ base",
        "b_peak_mib": "B peak MiB",
    }  # fmt: skip
    order = (
        "model",
        "system",
        "compile",
        "offload",
        "layout",
        "prefix_len",
        "n",
        "world_size",
        "parallel_layout",
    )
    sp = sp.sort_values([c for c in order if c in sp])
    table = sp[[c for c in cols if c in sp.columns]].rename(columns=cols)
    if "ideal" in table.columns:
        table.insert(table.columns.get_loc("ideal") + 1, "of ideal", table["speedup"] / table["ideal"])
    if "parallel" in table.columns:
        table["vs single"] = _vs_single(sp).to_numpy()
    for c in ("P", "S", "N"):
        table[c] = table[c].astype(int)
    if "microbatch" in table.columns:  # None = the whole group in one microbatch
        table["microbatch"] = table["microbatch"].map(_microbatch_label)
    if "groups" in table.columns:
        table["groups"] = table["groups"].map(lambda g: "-" if g != g else str(int(g)))
    table = table.dropna(axis=1, how="all")
    table.attrs["git_rev"] = sp["git_rev"] if "git_rev" in sp.columns else None
    return table.reset_index(drop=True)


def _microbatch_label(m) -> str:
    if m is None or m != m:
        return "all"
    return str(int(m)) if isinstance(m, (int, float)) else str(m)


PARALLEL_COLUMNS = (
    "tp", "cp", "pp", "dp", "ep", "world_size", "dp_replicate", "dp_shard", "groups_per_step", "parallel_layout",
)  # fmt: skip


def _vs_single(sp: pd.DataFrame) -> pd.Series:
    """Each row's speedup over the single-process speedup of the same configuration (same model, lengths,
    system, ...; only the parallel layout differs): the scale-out target is >= 0.9. NaN without that row."""
    keys = [c for c in sp.columns if c in CONFIG_COLUMNS and c not in PARALLEL_COLUMNS]
    keys += ["system", "offload"]
    skeys = {f"_k_{c}": as_key(sp[c]) for c in keys}
    frame = sp.assign(**skeys).reset_index(drop=True)
    single = frame[frame["parallel_layout"] == "single"].groupby(list(skeys), dropna=False)["speedup"]
    single = single.median()
    ref = frame[list(skeys)].merge(single.rename("_single").reset_index(), on=list(skeys), how="left")
    return (frame["speedup"] / ref["_single"]).reset_index(drop=True)


def speedup_table(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    table = speedup_frame(df)
    if table.empty:
        raise SkipFigure("no baseline/system pairs for a speedup table")
    caption = "Measured speedup over the baseline (median step time), the corrected ideal and the paper's"
    revs = table.attrs.pop("git_rev", None)
    warning = revision_warning(pd.DataFrame({"git_rev": revs}), "speedup table") if revs is not None else None
    if warning:
        caption += f". WARNING: {warning}"
    return _write(out_dir, "speedup", table, caption)


def _microbatch_label(value) -> str:
    return "all" if value is None or value != value else str(int(value))


def peer_frame(df: pd.DataFrame, peer: str = "prefix_grouper") -> pd.DataFrame:
    """Every PrefixFlow system against ``peer`` measured in the same cell: step time and whole-step peak
    (same scope on both sides) as ratios, the microbatching each ran (``auto``: the sizes it chose)."""
    m = measured(df)
    if m.empty or not {"cell_id", "system"} <= set(m.columns) or not (m["system"] == peer).any():
        return pd.DataFrame()
    m = m.assign(is_auto=flag(m, "microbatch_auto"))
    rows = []
    for _, cell in m.groupby("cell_id"):
        ref = cell[cell["system"] == peer]
        if ref.empty:
            continue
        ref = ref.iloc[0]
        for r in cell[cell["system"].astype(str).str.startswith("prefixflow")].itertuples():
            mb = (
                f"auto ({getattr(r, 'microbatch_sizes', '')})"
                if r.is_auto
                else _microbatch_label(r.microbatch)
            )
            rows.append({
                "model": r.model, "system": r.system, "attention": getattr(r, "attention", None),
                "P": int(r.prefix_len), "S": int(r.suffix_len), "N": int(r.n), "microbatch": mb,
                "budget MiB": getattr(r, "memory_budget_bytes", float("nan")) / MIB,
                "step s": r.step_time_s, f"{peer} s": ref["step_time_s"],
                "time ÷ peer": r.step_time_s / ref["step_time_s"],
                "peak MiB": r.peak_mem_bytes / MIB, f"{peer} peak MiB": ref["peak_mem_bytes"] / MIB,
                "peak ÷ peer": r.peak_mem_bytes / ref["peak_mem_bytes"],
                "git_rev": getattr(r, "git_rev", None),
            })  # fmt: skip
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    return out.sort_values(["model", "system", "P", "N", "microbatch"]).dropna(axis=1, how="all")


def peer_table(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    table = peer_frame(df)
    if table.empty:
        raise SkipFigure("no cells with PrefixFlow and prefix_grouper side by side")
    caption = "PrefixFlow against PrefixGrouper in the same cell: step time and whole-step peak memory"
    warning = revision_warning(table, "PrefixGrouper table")
    if warning:
        caption += f". WARNING: {warning}"
    return _write(out_dir, "vs_prefix_grouper", table.drop(columns="git_rev", errors="ignore"), caption)


def load_alignment(source) -> pd.DataFrame:
    """An alignment table from a DataFrame, a .parquet/.csv file, or a folder of such files."""
    if isinstance(source, pd.DataFrame):
        return source
    path = Path(source)
    files = [path] if path.is_file() else sorted([*path.glob("*.parquet"), *path.glob("*.csv")])
    frames = [pd.read_parquet(f) if f.suffix == ".parquet" else pd.read_csv(f) for f in files]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


ALIGN_VALUES = (
    "step", "quantity", "max_abs_diff", "max_abs_value", "pass", "passed", "norm_rel_diff", "norm_tol",
    "worst_tensor", "tau_abs", "tau_rel", "paper_pass", "margin", "git_rev", "timestamp",
)  # fmt: skip
CORRECT_RUN = "prefixflow"


def _microbatch_label(m) -> str:
    if m is None or m != m:
        return "all"
    return str(int(m)) if isinstance(m, int | float) else str(m)


def alignment_frame(align: pd.DataFrame) -> pd.DataFrame:
    """Table 3: per run (the correct PrefixFlow copy, then each negative control) and step, the max |diff|
    of gradients (G), loss (L) and updated weights (W), the normwise differences, and the verdict.

    Every other column (model, dtype, layout, microbatch, parallel layout, ...) is a leading row key. Rows of
    older records without ``run``/normwise columns render with ``run`` = prefixflow and "-" for the rest.
    """
    need = {"step", "quantity", "max_abs_diff"}
    if align.empty or not need <= set(align.columns) or not {"pass", "passed"} & set(align.columns):
        return pd.DataFrame()
    a = align.copy()
    if "passed" in a.columns:  # `align --out` rows say "pass", alignment cells' records "passed": one column
        a["pass"] = (
            a["passed"] if "pass" not in a.columns else a["pass"].where(a["pass"].notna(), a["passed"])
        )
        a = a.drop(columns="passed")
    a["run"] = a["run"].fillna(CORRECT_RUN) if "run" in a.columns else CORRECT_RUN  # older rows have none
    for col in ("norm_rel_diff", "norm_tol", "margin"):
        if col not in a.columns:
            a[col] = float("nan")
    keys = [c for c in a.columns if c not in ALIGN_VALUES and c != "run"]
    if "microbatch" in a.columns:  # rows from before the column: the whole group in one microbatch
        a["microbatch"] = a["microbatch"].astype(object).map(_microbatch_label)
    a[keys] = a[keys].map(str) if keys else a[keys]
    index = [*keys, "run", "step"]
    wide = a.pivot_table(index=index, columns="quantity", values="max_abs_diff", aggfunc="max")
    wide = wide[[q for q in ALIGN_QUANTITIES if q in wide.columns]]
    wide.columns = [f"max|d{q}|" for q in wide.columns]
    g = a[a["quantity"] == "G"].set_index(index)
    w = a[a["quantity"] == "W"].set_index(index)
    wide["G norm"] = g["norm_rel_diff"]
    wide["G bound"] = g["norm_tol"]
    wide["W update norm"] = w["norm_rel_diff"]
    verdict = a.groupby(index)["pass"].all().map({True: "pass", False: "FAIL"})
    margin = g["margin"].map(lambda m: "" if m != m else f"x{m:.3g}")
    wide["result"] = verdict + margin.reindex(verdict.index).fillna("").map(lambda m: f" ({m})" if m else "")
    out = wide.reset_index()
    out["_control"] = out["run"] != CORRECT_RUN
    out = out.sort_values([*keys, "_control", "run", "step"], kind="stable").drop(columns="_control")
    return out.dropna(axis=1, how="all").reset_index(drop=True)


def alignment_table(align, out_dir: str | Path) -> list[Path]:
    rows = load_alignment(align)
    table = alignment_frame(rows)
    if table.empty:
        raise SkipFigure("no alignment records (columns step, quantity, max_abs_diff, pass)")
    caption = (
        "Table 3: multi-step alignment with the baseline (G gradients, L loss, W weights); negative controls "
        "(injected faults) must FAIL, (xK) = their G normwise difference over the correct run's"
    )
    warning = revision_warning(rows, "Table 3")
    if warning:
        caption += f". WARNING: {warning}"
    return _write(out_dir, "table3_alignment", table, caption)
