"""``pf-bench frontier``: does a shape fit a memory budget, and what is the largest total length that fits,
for a model and a layout, estimated on fake tensors (``harness.capacity``; docs/estimate.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import pandas as pd
import typer
from pydantic import ValidationError
from rich.text import Text

from harness.cli.common import (
    AC,
    Cp,
    DpReplicate,
    DpShard,
    DType,
    Ep,
    Layout,
    Pp,
    Tp,
    _fail,
    _json_safe,
    _option_errors,
    _table,
    console,
    err_console,
)
from harness.cli.run import checked_cell
from harness.spec.cell import FrontierSearch, Parallel

__all__ = ["frontier"]

GIB = 2**30


def _search(
    budget: int, ratio: float | None, prefix_len: int | None, fits: int | None, lengths
) -> FrontierSearch:
    min_len, max_len, resolution = lengths
    if fits is not None:  # one probe: the search's bracket is that length alone
        min_len = max_len = fits
    fields = dict(budget_bytes=budget, min_len=min_len, max_len=max_len, resolution=resolution)
    if prefix_len is not None:
        fields.update(mode="prefix", prefix_len=prefix_len)
    else:
        fields.update(mode="ratio", ratio=ratio)
    try:
        return FrontierSearch(**fields)
    except ValidationError as e:
        _fail(_option_errors(e, {"budget_bytes": "--budget", "min_len": "--min-len", "max_len": "--max-len"}))


def frontier(
    model: Annotated[str, typer.Option(help="'family:flavor' (llama3:8B, qwen3:0.6B ...) or hf:<config>")],
    budget: Annotated[str, typer.Option(help="device memory per rank: bytes or 96GiB, 80G, 141GB ...")],
    override: Annotated[list[str], typer.Option(help="ModelArgs override FIELD=VALUE (repeatable)")] = [],  # noqa: B006
    ratio: Annotated[
        float | None, typer.Option(help="prefix ratio P/(P+S) of the searched total length (default 5/6)")
    ] = None,
    prefix_len: Annotated[
        int | None, typer.Option(min=1, help="fix the prefix P and search the suffix S instead")
    ] = None,
    fits: Annotated[
        int | None,
        typer.Option(min=2, help="only ask whether this length fits (P+S, or S with --prefix-len)"),
    ] = None,
    min_len: Annotated[int, typer.Option(min=2, help="the search's first probe")] = 2048,
    max_len: Annotated[int, typer.Option(min=2, help="the longest length probed")] = 131072,
    resolution: Annotated[int, typer.Option(min=1, help="the search stops this close to the limit")] = 512,
    variants: Annotated[
        str, typer.Option(help="comma-separated systems; SYSTEM+offload for PrefixFlow with offload")
    ] = "baseline,prefixflow+offload",
    n: Annotated[int, typer.Option(min=1, help="responses per group N")] = 2,
    microbatch: Annotated[int | None, typer.Option(min=1, help="responses per microbatch (default: 1)")] = 1,
    layout: Layout = Layout.padded,
    dtype: DType = DType.bf16,
    ac: AC = AC.selective,
    dp_replicate: DpReplicate = 1,
    dp_shard: DpShard = 1,
    cp: Cp = 1,
    tp: Tp = 1,
    pp: Pp = 1,
    ep: Ep = 1,
    jobs: Annotated[int, typer.Option(min=1, help="searches run at once (one process each)")] = 1,
    timeout_min: Annotated[float, typer.Option(min=1, help="per search")] = 120.0,
    out: Annotated[Path, typer.Option(help="results folder: probes go to OUT/frontier/ (resumable)")] = Path(
        "results"
    ),
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Estimate the capacity frontier: the largest length that fits --budget per variant (or, with --fits,
    whether one length fits), for a model and a layout, on fake tensors."""
    from harness.capacity import FRONTIER_SPEC, frontier_cells, parse_size, search_frontier
    from harness.contenders import available_contenders
    from harness.run.progress import reporting
    from harness.safe_fs import UnsafePathError, check_writable
    from harness.sweep import spec_folder

    try:
        budget_bytes = parse_size(budget)
    except ValueError as e:
        _fail(f"--budget: {e}")
    if prefix_len is not None and ratio is not None:
        _fail("--ratio and --prefix-len: give one (a fixed split, or a fixed prefix and a growing suffix)")
    if prefix_len is None and ratio is None:
        ratio = 5 / 6
    if fits is None and max_len < min_len:
        _fail(f"--max-len {max_len} is below --min-len {min_len}")
    search = _search(budget_bytes, ratio, prefix_len, fits, (min_len, max_len, resolution))
    names = [v.strip() for v in variants.split(",") if v.strip()]
    known = available_contenders()
    for name in names or [""]:
        if name.removesuffix("+offload") not in known:
            _fail(f"--variants: unknown system {name!r}; registered: {', '.join(known)} (SYSTEM+offload)")
    parallel = Parallel(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, ep=ep)
    fields = dict(n=n, microbatch=microbatch, layout=layout.value, dtype=dtype.value, ac=ac.value)
    longest = search.split(search.max_len)
    for name in names:  # each variant's longest probe, checked as `run` checks a cell (model, positions)
        system, offload = name.removesuffix("+offload"), name.endswith("+offload")
        cell = checked_cell(
            model, override, system, True, prefix_len=longest[0], suffix_len=longest[1], offload=offload,
            parallel=parallel, device="cpu", warmup=0, repeats=1, **fields,
        )  # fmt: skip
    try:
        cells = frontier_cells(cell.model, search, names, parallel, timeout_min, **fields)
    except ValidationError as e:
        _fail(_option_errors(e))
    try:
        check_writable(spec_folder(out, FRONTIER_SPEC), out)
    except (OSError, UnsafePathError) as e:
        _fail(f"--out {out}: {getattr(e, 'strerror', None) or e}")
    what = (
        f"does {search.min_len} fit" if fits is not None else f"frontier {search.min_len}..{search.max_len}"
    )
    err_console.print(
        Text(f"{what} in {budget_bytes / GIB:.2f} GiB, {parallel.label}: {len(cells)} searches")
    )

    def done(cell, status: str) -> None:
        err_console.print(Text(f"search {cell.cell_id} ({_variant(cell)}): {status}", style="dim"))

    try:
        with reporting(lambda msg: err_console.print(Text(msg, style="dim"))):
            probes = search_frontier(cells, out, jobs=jobs, on_done=done)
    except (RuntimeError, ValueError, OSError) as e:  # a lock held, an unsafe path, the disk
        _fail(str(e))
    _report(probes, budget_bytes, fits is not None, as_json)


def _variant(cell) -> str:
    return cell.systems[0] + ("+offload" if cell.offload else "")


def _report(probes: pd.DataFrame, budget: int, one: bool, as_json: bool) -> None:
    """The probes and each variant's frontier (or, ``one``, whether the one length fits); exit 1 when a
    probe could not be estimated."""
    from harness.figures.fig10 import frontier_table

    failed = probes[~probes["status"].isin(["ok", "oom"])]
    shown, front, _ = frontier_table(probes[probes["status"].isin(["ok", "oom"])], budget=float(budget))
    if not front.empty:
        front = front.assign(fits=front["max_total"] > 0) if one else front
    if as_json:
        rows = [_json_safe(r) for r in front.to_dict("records")] if not front.empty else []
        errors = [
            {"system": r["system"], "status": r["status"], "error": r.get("error")}
            for r in failed.to_dict("records")
        ]
        typer.echo(json.dumps({"budget_bytes": budget, "frontier": rows, "failed": errors}, default=str))
    else:
        if not shown.empty:
            cols = ["variant", "prefix_len", "suffix_len", "total", "peak_mem_bytes", "fits"]
            table = shown[cols].assign(peak_GiB=shown["peak_mem_bytes"] / GIB).drop(columns="peak_mem_bytes")
            console.print(
                _table(table.sort_values(["variant", "total"]), title="probes (rank-max peak, estimated)")
            )
        if not front.empty:
            if one:
                verdict = front[["variant", "fits", "prefix_len", "suffix_len"]]
                console.print(_table(verdict, title=f"fits in {budget / GIB:.2f} GiB"))
            else:
                console.print(_table(front, title=f"largest total length within {budget / GIB:.2f} GiB"))
                for v in front.loc[front["max_total"] == 0, "variant"]:
                    err_console.print(
                        Text(f"{v}: its first probe does not fit; lower --min-len", style="yellow")
                    )
    for rec in failed.to_dict("records"):
        lines = [line for line in str(rec.get("error") or "").splitlines() if line.strip()]
        first = (lines[-1] if lines[0].startswith("Traceback") else lines[0]) if lines else ""  # the cause
        err_console.print(Text(f"{rec['system']}: {rec['status']}: {first}", style="red"))
    if not failed.empty:
        raise typer.Exit(1)
