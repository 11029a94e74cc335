"""``pf-bench run``: one cell from the command line, its records printed (and written with ``--out``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import pandas as pd
import typer
from pydantic import ValidationError
from rich.markup import escape
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
    _int_or_text,
    _json_safe,
    _option_errors,
    _table,
    console,
    err_console,
    parse_overrides,
)
from harness.spec.cell import Cell, ModelSpec, Parallel

__all__ = ["RUN_COLUMNS", "ESTIMATE_COLUMNS", "checked_cell", "run"]


RUN_COLUMNS = [
    "system",
    "status",
    "step_time_s",
    "step_time_min_s",
    "step_time_max_s",
    "phase_a_s",
    "phase_b_s",
    "phase_c_s",
    "peak_mem_bytes",
    "peak_mem_phase_b_bytes",
    "mem_meter",
    "offload_tier",
    "offloaded_bytes",
    "prefetched_bytes",
    "demand_loaded_bytes",
    "parallel_layout",
    "step_time_s_spread",
    "grad_sync",
    "fsdp_reduce_scatters_per_unit",
    "split_groups",
    "split_kv_bytes",
    "split_grad_kv_bytes",
    "split_exchange_exact",
]
ESTIMATE_COLUMNS = [
    "system",
    "status",
    "peak_mem_phase_a_bytes",
    "peak_mem_phase_b_bytes",
    "peak_mem_phase_c_bytes",
    "peak_mem_bytes",
    "counted_flops",
    "offloaded_bytes",
    "mem_meter",
    "estimate_s",
]


def run(
    model: Annotated[
        str,
        typer.Option(
            help="TorchTitan 'family:flavor' (llama3:debugmodel) or hf:<config name or local config.json>"
        ),
    ],
    prefix_len: Annotated[int, typer.Option(help="prompt (shared prefix) length P")],
    suffix_len: Annotated[int, typer.Option(help="response length S")],
    n: Annotated[int, typer.Option(help="responses per group N")],
    override: Annotated[list[str], typer.Option(help="ModelArgs override FIELD=VALUE (repeatable)")] = [],  # noqa: B006
    layout: Layout = Layout.padded,
    microbatch: Annotated[
        str | None,
        typer.Option(help="responses per microbatch (default: all), or 'auto' (needs --memory-budget)"),
    ] = None,
    memory_budget: Annotated[
        str | None,
        typer.Option(help="for --microbatch auto: bytes, or 'peak:SYSTEM' (that system's measured peak)"),
    ] = None,
    dtype: DType = DType.fp32,
    systems: Annotated[str, typer.Option(help="comma-separated systems")] = "baseline,prefixflow",
    warmup: int = 1,
    repeats: int = 3,
    compile: Annotated[bool, typer.Option("--compile", help="torch.compile each block")] = False,
    ac: AC = AC.none,
    offload: Annotated[bool, typer.Option("--offload", help="offload dormant prefix activations")] = False,
    seed: int = 0,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda")] = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON record per system")] = False,
    out: Annotated[Path | None, typer.Option(help="also write the Parquet record under OUT/adhoc/")] = None,
    dp_replicate: DpReplicate = 1,
    dp_shard: DpShard = 1,
    cp: Cp = 1,
    tp: Tp = 1,
    pp: Pp = 1,
    ep: Ep = 1,
    groups: Annotated[
        int | None, typer.Option(min=1, help="groups per step (default: one per data-parallel rank)")
    ] = None,
    split_threshold: Annotated[
        float, typer.Option(min=0, help="split a group when the busiest DP rank exceeds the mean by this")
    ] = 0.25,
    estimate: Annotated[
        bool,
        typer.Option(
            "--estimate",
            help="estimate per-phase peak memory and FLOPs on fake tensors instead of running (docs/estimate.md)",
        ),
    ] = False,
) -> None:
    """Run one cell and print its records (a layout with several ranks runs on local ranks, loopback only)."""
    from harness.execute.local import run_cell
    from harness.records import write_records
    from harness.run.progress import reporting
    from harness.safe_fs import UnsafePathError, check_writable
    from harness.sweep import spec_folder

    cell = checked_cell(
        model,
        override,
        systems,
        estimate,
        prefix_len=prefix_len,
        suffix_len=suffix_len,
        n=n,
        layout=layout.value,
        microbatch=_int_or_text(microbatch),
        memory_budget=_int_or_text(memory_budget),
        dtype=dtype.value,
        compile=compile,
        ac=ac.value,
        offload=offload,
        parallel=Parallel(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, ep=ep),
        groups=groups,
        split_threshold=split_threshold,
        seed=seed,
        device=device,
        warmup=warmup,
        repeats=repeats,
    )
    folder = None if out is None else spec_folder(out, cell.spec)
    if folder is not None:  # before the cell runs, not after
        try:
            check_writable(folder, out)
        except (OSError, UnsafePathError) as e:
            _fail(f"--out {out}: {getattr(e, 'strerror', None) or e}")
    if cell.world_size > 1:
        err_console.print(Text(f"cell {cell.cell_id}: {cell.world_size} local ranks", style="dim"))
    with reporting(lambda msg: err_console.print(Text(f"cell {cell.cell_id}: {msg}", style="dim"))):
        if estimate:
            from harness.estimate import estimate_cell

            records = estimate_cell(cell)
        else:
            records = run_cell(cell)
    if folder is not None:
        try:
            path = write_records(folder / f"{cell.cell_id}.parquet", records, root=out)
        except (OSError, UnsafePathError) as e:
            _fail(f"--out {out}: cannot write the record ({getattr(e, 'strerror', None) or e})")
        err_console.print(Text(f"record: {path}"))
    if as_json:
        for rec in records:
            typer.echo(json.dumps(_json_safe(rec)))
    else:
        df = pd.DataFrame(records)
        shown = ESTIMATE_COLUMNS if estimate else RUN_COLUMNS
        cols = [c for c in shown if c in df.columns and df[c].notna().any()]  # no empty offload columns
        console.print(_table(df[cols], title=f"cell {cell.cell_id}"))
    for rec in records:
        if rec["status"] != "ok":
            err_console.print(
                f"[red]{escape(rec['system'])}: {rec['status']}[/red]\n{escape(str(rec['error']))}"
            )
    if any(rec["status"] != "ok" for rec in records):
        raise typer.Exit(1)


def checked_cell(model: str, override: list[str], systems: str, estimate: bool, **fields) -> Cell:
    """The ad-hoc cell of ``run``'s options (``fields``: the other :class:`Cell` fields), validated as ``run``
    validates it before it runs (``pf-bench workload --estimate`` builds its cell here too): every bad option
    exits with one line naming it. ``estimate``: checked for the fake path, else preflighted on the meta
    device against this machine."""
    from harness.contenders import available_contenders
    from harness.run.memory import preflight_cell
    from harness.spec.checks import check_model_spec
    from harness.spec.schema import CellLimits

    try:
        model_spec = ModelSpec(name=model, overrides=parse_overrides(override))
    except ValidationError as e:
        _fail(_option_errors(e, {"name": "--model", "overrides": "--override"}))
    try:
        cell = Cell(
            spec="adhoc",
            model=model_spec,
            systems=tuple(s.strip() for s in systems.split(",") if s.strip()),
            **fields,
        )
    except ValidationError as e:
        _fail(_option_errors(e))
    unknown = [s for s in cell.systems if s not in available_contenders()]
    if unknown:
        _fail(f"--systems: unknown system {unknown[0]!r}; registered: {', '.join(available_contenders())}")
    try:  # a spec's default limits on one cell's work (a spec's limits: block raises them)
        CellLimits().check("--n x (--prefix-len + --suffix-len)", cell.n, cell.prefix_len + cell.suffix_len)
    except ValueError as e:
        _fail(f"{e} (in a spec's limits: block)")
    try:
        check_model_spec(cell.model)
    except (ValueError, TypeError) as e:
        _fail(f"--model/--override: {e}")
    if estimate:
        from harness.estimate import unsupported
        from harness.run.memory import check_cell_sequences

        if (why := unsupported(cell)) is not None:
            _fail(why)
        try:  # the sequences against the model's positions; the memory floor is what the estimate finds
            check_cell_sequences([cell])
        except ValueError as e:
            _fail(str(e))
    else:
        try:  # on the meta device: the sequences fit the model and its memory floor fits this machine
            preflight_cell(cell)
        except ValueError as e:
            _fail(str(e))
    return cell
