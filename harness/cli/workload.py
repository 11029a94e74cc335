"""``pf-bench workload ROLLOUTS``: a user's rollouts measured as the paper's Table 1 (prefix ratios, group sizes,
shared tokens), and with ``--model ... --estimate`` PrefixFlow's FLOP saving and Phase-B memory at one
representative cell (docs/workload.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from harness.cli.common import AC, DType, Layout, _fail, _fmt, console, err_console
from harness.cli.run import checked_cell
from harness.rollout_stats import (
    MAX_BYTES,
    MAX_ROWS,
    PERCENTILES,
    RolloutError,
    WorkloadStats,
    read_rollouts,
    representative,
    workload_stats,
)
from harness.spec.cell import Parallel

__all__ = ["workload", "estimate_workload"]

SYSTEMS = ("baseline", "prefixflow")


def estimate_workload(stats: WorkloadStats, model: str, override: list[str], **options) -> dict[str, Any]:
    """The estimate of ``stats``' representative cell (:func:`representative`) at ``model``: per system the
    cost model's FLOPs (``model_flops``; NaN under activation checkpointing), the counted FLOPs and the
    Phase-B and overall peak live bytes of the fake step (``harness.estimate``), and PrefixFlow's savings."""
    from harness.estimate import estimate_cell
    from harness.run.progress import reporting

    p, s, n = representative(stats)
    cell = _cell(model, override, p, s, n, options)
    with reporting(lambda msg: err_console.print(Text(f"cell {cell.cell_id}: {msg}", style="dim"))):
        records = {r["system"]: r for r in estimate_cell(cell)}
    for rec in records.values():
        if rec["status"] != "ok":
            _fail(f"--estimate: {rec['system']}: {rec['status']}: {str(rec.get('error')).splitlines()[0]}")
    keys = ("model_flops", "counted_flops", "peak_mem_phase_b_bytes", "peak_mem_bytes")
    out: dict[str, Any] = {"cell_id": cell.cell_id, "prefix_len": p, "suffix_len": s, "n": n}
    out["systems"] = {name: {k: _number(records[name].get(k)) for k in keys} for name in SYSTEMS}
    base, pf = out["systems"]["baseline"], out["systems"]["prefixflow"]
    out["flop_saving"] = _saving(pf["model_flops"], base["model_flops"])
    out["counted_flop_saving"] = _saving(pf["counted_flops"], base["counted_flops"])
    out["phase_b_memory_ratio"] = _ratio(pf["peak_mem_phase_b_bytes"], base["peak_mem_phase_b_bytes"])
    out["peak_memory_ratio"] = _ratio(pf["peak_mem_bytes"], base["peak_mem_bytes"])
    return out


def _cell(model: str, override: list[str], p: int, s: int, n: int, options: dict):
    """The estimate's cell, validated by ``pf-bench run``'s code (one line naming a bad option)."""
    return checked_cell(
        model,
        override,
        ",".join(SYSTEMS),
        True,
        prefix_len=p,
        suffix_len=s,
        n=n,
        parallel=Parallel(),
        **options,
    )


def _number(v) -> float | None:
    return None if v is None or (isinstance(v, float) and not math.isfinite(v)) else float(v)


def _ratio(a, b) -> float | None:
    return None if a is None or not b else a / b


def _saving(a, b) -> float | None:
    r = _ratio(a, b)
    return None if r is None else 1.0 - r


def _stats_tables(stats: WorkloadStats, source: str) -> list[Table]:
    head = Table(title=Text(f"rollouts: {source}"), show_header=False)
    for k, v in (
        ("layout", stats.layout),
        ("samples", stats.samples),
        ("groups", stats.groups),
        ("groups of one sample", stats.singleton_groups),
        ("tree groups (the trie shares more than one prefix)", stats.tree_groups),
    ):
        head.add_row(Text(k), Text(str(v)))
    dist = Table(title=Text("per sample (group size: per group)"))
    cols = ("mean", *(f"p{q}" for q in PERCENTILES), "min", "max")
    for c in ("", *cols):
        dist.add_column(Text(c), justify="right" if c else "left")
    for name, d in (
        ("prefix ratio |P|/(|P|+|S|)", stats.prefix_ratio),
        ("prefix length |P|", stats.prefix_len),
        ("suffix length |S|", stats.suffix_len),
        ("group size N", stats.group_size),
    ):
        dist.add_row(Text(name), *(Text(_fmt(d[c])) for c in cols))
    tokens = Table(title=Text("tokens trained"))
    for c in ("", "tokens", "saved vs baseline"):
        tokens.add_column(Text(c), justify="right" if c else "left")
    tokens.add_row(Text("baseline: Σ (P + S)"), Text(str(stats.baseline_tokens)), Text("-"))
    tokens.add_row(
        Text("shared: P once per group + Σ S"),
        Text(str(stats.shared_tokens)),
        Text(f"{stats.shared_fraction:.2%}"),
    )
    tokens.add_row(
        Text("tree: each group's prefix trie"),
        Text(str(stats.tree_tokens)),
        Text(f"{stats.tree_shared_fraction:.2%}"),
    )
    return [head, dist, tokens]


def _estimate_table(est: dict[str, Any], model: str) -> Table:
    title = f"{model} at P={est['prefix_len']}, S={est['suffix_len']}, N={est['n']} (cell {est['cell_id']})"
    table = Table(title=Text(title))
    cols = {
        "model_flops": ("cost model FLOPs", 1),
        "counted_flops": ("counted FLOPs", 1),
        "peak_mem_phase_b_bytes": ("Phase-B peak MiB", 2**20),
        "peak_mem_bytes": ("peak MiB", 2**20),
    }
    table.add_column(Text("system"))
    for name, _ in cols.values():
        table.add_column(Text(name), justify="right")
    for system, row in est["systems"].items():
        cells = [
            "-" if row[c] is None else (f"{row[c] / d:,.1f}" if d > 1 else _fmt(row[c]))
            for c, (_, d) in cols.items()
        ]
        table.add_row(Text(system), *(Text(c) for c in cells))

    def pct(v) -> str:
        return "-" if v is None else f"{v:.2%}"

    table.caption = Text(
        f"FLOP saving (cost model) {pct(est['flop_saving'])}, counted {pct(est['counted_flop_saving'])}; "
        f"Phase-B peak PrefixFlow/baseline {_fmt(est['phase_b_memory_ratio'])}"
    )
    return table


def workload(
    rollouts: Annotated[
        Path, typer.Argument(help="a .jsonl or .parquet file of rollouts, or a pf-bench rl trace folder")
    ],
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    max_bytes: Annotated[int, typer.Option(min=1, help="refuse a larger file")] = MAX_BYTES,
    max_rows: Annotated[int, typer.Option(min=1, help="refuse more rows (samples)")] = MAX_ROWS,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            help="for logged text (TRL's completions, verl's generations): a Hugging Face tokenizer"
        ),
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="with --estimate: the model ('family:flavor' or hf:<config>)")
    ] = None,
    override: Annotated[list[str], typer.Option(help="ModelArgs override FIELD=VALUE (repeatable)")] = [],  # noqa: B006
    estimate: Annotated[
        bool,
        typer.Option(
            "--estimate",
            help="estimate PrefixFlow's FLOP saving and Phase-B memory at the median P, S and N (needs --model)",
        ),
    ] = False,
    layout: Layout = Layout.padded,
    microbatch: Annotated[
        int | None, typer.Option(min=1, help="responses per microbatch (default: all)")
    ] = None,
    dtype: DType = DType.fp32,
    ac: AC = AC.none,
    offload: Annotated[bool, typer.Option("--offload", help="offload dormant prefix activations")] = False,
) -> None:
    """Measure a user's rollouts as the paper's Table 1 does: prefix ratios, group sizes, shared tokens."""
    if estimate != (model is not None):
        _fail("--estimate needs --model, and --model is used only with --estimate")
    options = dict(
        layout=layout.value,
        microbatch=microbatch,
        dtype=dtype.value,
        ac=ac.value,
        offload=offload,
        device="cpu",
        warmup=0,
        repeats=1,
    )
    if estimate:  # the model and the options, before the file is read
        _cell(model, override, 1, 1, 1, options)
    try:
        stats = workload_stats(
            read_rollouts(rollouts, max_bytes=max_bytes, max_rows=max_rows, tokenizer=tokenizer)
        )
    except RolloutError as e:
        _fail(f"ROLLOUTS: {e}")
    est = None
    if estimate:
        est = estimate_workload(stats, model, override, **options)
    if as_json:
        typer.echo(json.dumps({"rollouts": str(rollouts), **stats.as_dict(), "estimate": est}))
        return
    for table in _stats_tables(stats, str(rollouts)):
        console.print(table)
    if est is not None:
        console.print(_estimate_table(est, model))
