"""``pf-bench``: the harness command line (thin: parse, call, print)."""

from __future__ import annotations

import json
import math
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import pandas as pd
import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from harness.spec import DEFAULT_MAX_CELLS, Cell, ModelSpec, Parallel, SpecError, check_cell_count, load_spec

app = typer.Typer(
    help="PrefixFlow benchmark harness: specs -> cells -> records -> figures.",
    no_args_is_help=True,
    add_completion=False,
)
ALIGNMENT_DIR = "_alignment"  # under a results folder; underscore folders hold no cell records
_WIDTH = None if sys.stdout.isatty() else 200  # no truncated tables in logs and pipes
console = Console(width=_WIDTH)
err_console = Console(stderr=True, width=_WIDTH)


class LossName(StrEnum):
    pg = "pg"
    grpo = "grpo"


class Layout(StrEnum):
    padded = "padded"
    packed = "packed"


class DType(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp64 = "fp64"


class AC(StrEnum):
    none = "none"
    selective = "selective"
    full = "full"


class ExecutorKind(StrEnum):
    local = "local"
    slurm = "slurm"
    debug = "debug"


class Preset(StrEnum):
    cpu = "cpu"
    paper = "paper"


def _fail(msg: str, code: int = 2) -> NoReturn:
    """Print a user error (its text is data: escaped, never Rich markup) and exit with ``code``."""
    err_console.print(f"[red]error:[/red] {escape(msg)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _warn(msg: str) -> None:
    err_console.print(f"[yellow]warning:[/yellow] {escape(msg)}", highlight=False, soft_wrap=True)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``FIELD=VALUE`` pairs; values become int, float or bool where they parse as one, else str."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{item!r} is not FIELD=VALUE (e.g. dim=64)", param_hint="--override")
        value: Any = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            for conv in (int, float):
                try:
                    value = conv(raw)
                    break
                except ValueError:
                    continue
        out[key] = value
    return out


def _json_safe(rec: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in rec.items()}


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _table(df: pd.DataFrame, title: str | None = None) -> Table:
    """A Rich table of ``df``; every title, header and cell is plain text (records are untrusted data)."""
    table = Table(title=Text(title) if title is not None else None)
    for col in df.columns:
        table.add_column(Text(str(col)))
    for row in df.itertuples(index=False):
        table.add_row(*(Text(_fmt(v)) for v in row))
    return table


def _option_errors(err: ValidationError, names: dict[str, str] | None = None) -> str:
    """Pydantic errors as '--option: message': a field is named after the option that sets it (``names``
    maps the others), and a union's per-type alternatives collapse into one message."""
    parts: dict[str, str] = {}
    for e in err.errors():
        first = str(e["loc"][0]) if e["loc"] else ""
        option = (names or {}).get(first) or f"--{first.replace('_', '-')}"
        rest = [str(p) for p in e["loc"][1:] if p not in ("int", "float", "bool", "str")]
        parts.setdefault(".".join([option, *rest]), e["msg"])
    return "; ".join(f"{where}: {msg}" for where, msg in parts.items())


# The parallel flags of `run` and `align`: TorchTitan's mesh dimension names.
DpReplicate = Annotated[
    int, typer.Option("--dp-replicate", min=1, help="data-parallel replicas (all-reduce)")
]
DpShard = Annotated[int, typer.Option("--dp-shard", min=1, help="FSDP2 ranks (parameters sharded)")]
Cp = Annotated[int, typer.Option("--cp", min=1, help="context parallel degree")]
Tp = Annotated[int, typer.Option("--tp", min=1, help="tensor parallel degree (TorchTitan's plans)")]
Pp = Annotated[int, typer.Option("--pp", min=1, help="pipeline parallel degree")]
Ep = Annotated[int, typer.Option("--ep", min=1, help="expert parallel degree")]

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


@app.command()
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
) -> None:
    """Run one cell and print its records (a layout with several ranks runs on local ranks, loopback only)."""
    from harness.records import write_records
    from harness.runner import run_cell
    from harness.safe_fs import UnsafePathError, check_writable
    from harness.spec_checks import check_model_spec
    from harness.sweep import spec_folder
    from harness.systems import available_systems

    try:
        model_spec = ModelSpec(name=model, overrides=parse_overrides(override))
    except ValidationError as e:
        _fail(_option_errors(e, {"name": "--model", "overrides": "--override"}))
    try:
        cell = Cell(
            spec="adhoc",
            model=model_spec,
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
            systems=tuple(s.strip() for s in systems.split(",") if s.strip()),
            seed=seed,
            device=device,
            warmup=warmup,
            repeats=repeats,
        )
    except ValidationError as e:
        _fail(_option_errors(e))
    unknown = [s for s in cell.systems if s not in available_systems()]
    if unknown:
        _fail(f"--systems: unknown system {unknown[0]!r}; registered: {', '.join(available_systems())}")
    try:
        check_model_spec(cell.model)
    except (ValueError, TypeError) as e:
        _fail(f"--model/--override: {e}")
    folder = None if out is None else spec_folder(out, cell.spec)
    if folder is not None:  # before the cell runs, not after
        try:
            check_writable(folder, out)
        except (OSError, UnsafePathError) as e:
            _fail(f"--out {out}: {getattr(e, 'strerror', None) or e}")
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
        cols = [c for c in RUN_COLUMNS if c in df.columns and df[c].notna().any()]  # no empty offload columns
        console.print(_table(df[cols], title=f"cell {cell.cell_id}"))
    for rec in records:
        if rec["status"] != "ok":
            err_console.print(
                f"[red]{escape(rec['system'])}: {rec['status']}[/red]\n{escape(str(rec['error']))}"
            )
    if any(rec["status"] != "ok" for rec in records):
        raise typer.Exit(1)


def _int_or_text(value: str | None):
    """An option that is an int or a keyword (``auto``, ``peak:SYSTEM``)."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return value


def _search_label(cell: Cell) -> str:
    """A capacity-frontier search cell in a few words ('-' for a measurement cell)."""
    if cell.alignment is not None:
        return f"alignment (Table 3), {cell.alignment.steps} steps"
    f = cell.frontier
    if f is None:
        return "-"
    fixed = f"ratio {f.ratio:.3g}" if f.mode == "ratio" else f"P={f.prefix_len}"
    budget = "device" if f.budget_bytes is None else f"{f.budget_bytes / 2**20:.0f} MiB"
    return f"frontier {fixed}, {f.min_len}..{f.max_len}/{f.resolution}, {budget}"


def _load(spec_path: Path, preset: Preset):
    try:
        return load_spec(spec_path, preset.value)
    except SpecError as e:
        _fail(str(e))


@app.command()
def sweep(
    spec: Annotated[Path, typer.Argument(help="sweep spec (YAML)")],
    executor: ExecutorKind = ExecutorKind.local,
    out: Annotated[Path, typer.Option(help="results folder")] = Path("results"),
    dry_run: Annotated[bool, typer.Option("--dry-run", help="list the cells and what would run")] = False,
    max_jobs: Annotated[int | None, typer.Option(min=1, help="concurrent cells (default: spec)")] = None,
    retry_failed: Annotated[bool, typer.Option("--retry-failed", help="rerun cells not ok")] = False,
    preset: Preset = Preset.cpu,
    max_cells: Annotated[
        int, typer.Option(min=1, help="refuse a spec that expands to more cells (a guard against typos)")
    ] = DEFAULT_MAX_CELLS,
) -> None:
    """Run every missing cell of SPEC (resumable: recorded cells are skipped). Exits 1 if a cell failed."""
    from harness.executors import make_executor
    from harness.safe_fs import UnsafePathError, check_writable, jobs_folder
    from harness.sweep import plan, run_sweep, spec_folder

    s = _load(spec, preset)
    try:
        check_cell_count(s, max_cells)
    except SpecError as e:
        _fail(str(e))
    if dry_run:
        try:
            p = plan(s, out, retry_failed, max_cells)
        except SpecError as e:
            _fail(str(e))
        for problem in p.invalid:
            _warn(f"ignoring {problem}; the cell would run again")
        todo = {c.cell_id for c in p.todo}
        rows = [
            {
                "cell_id": c.cell_id,
                "model": c.model.display,
                "P": c.prefix_len,
                "S": c.suffix_len,
                "N": c.n,
                "layout": c.layout,
                "mb": c.microbatch,
                "budget": c.memory_budget,
                "dtype": c.dtype,
                "compile": c.compile,
                "ac": c.ac,
                "offload": c.offload,
                "parallel": c.parallel.label,
                "world": c.world_size,
                "groups": c.groups_per_step,
                "systems": ",".join(c.systems),
                "search": _search_label(c),
                "state": "run" if c.cell_id in todo else f"done ({p.done[c.cell_id]})",
            }
            for c in p.cells
        ]
        table = pd.DataFrame(rows)
        if "budget" in table and table["budget"].isna().all():  # only microbatch "auto" cells have one
            table = table.drop(columns="budget")
        console.print(_table(table, title=f"{s.name}: {len(p.cells)} cells, {len(todo)} to run"))
        return
    try:
        check_writable(spec_folder(out, s.name), out)
    except (OSError, UnsafePathError) as e:
        _fail(f"--out {out}: {getattr(e, 'strerror', None) or e}")
    if executor is not ExecutorKind.debug:
        try:  # job files (and submitit's pickles) are only ever read from a private folder
            jobs_folder(spec_folder(out, s.name))
        except (OSError, UnsafePathError) as e:
            _fail(str(e))
    try:
        ex = make_executor(executor.value, s.executor, max_jobs)
    except (RuntimeError, ValueError) as e:
        _fail(str(e))
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task(escape(s.name), total=None)

        def on_start(p) -> None:
            progress.update(task, total=len(p.todo))
            for problem in p.invalid:
                _warn(f"ignoring {problem}; the cell runs again")
            progress.console.print(
                Text(
                    f"{s.name}: {len(p.cells)} cells, {len(p.done)} recorded, "
                    f"{len(p.todo)} to run ({executor.value}) -> {p.folder}"
                )
            )

        def on_done(cell, status: str) -> None:
            progress.advance(task)
            if status != "ok":
                progress.console.print(f"[yellow]cell {cell.cell_id}: {escape(status)}[/yellow]")

        try:
            p = run_sweep(
                s, out, ex, retry_failed=retry_failed, on_start=on_start, on_done=on_done, max_cells=max_cells
            )
        except (RuntimeError, ValueError, OSError) as e:  # SpecError, UnsafePathError, a lock held, disk
            _fail(str(e))
    counts = pd.Series(list(p.done.values())).value_counts().to_dict()
    console.print(
        Text(f"{s.name}: {len(p.cells)} cells, ran {len(p.todo)}; statuses {counts}; records in {p.folder}")
    )
    failed = p.failed
    if failed:
        by_status = pd.Series(list(failed.values())).value_counts().to_dict()
        err_console.print(
            Text(
                f"{s.name}: {len(failed)} of {len(p.cells)} cells failed {by_status}; their records hold the "
                f"errors (`pf-bench status {out}`); rerun them with --retry-failed",
                style="red",
            )
        )
        raise typer.Exit(1)


@app.command()
def status(results: Annotated[Path, typer.Argument(help="results folder")] = Path("results")) -> None:
    """Cells recorded per spec, by status, and how many are still missing."""
    from harness.sweep import status_table

    if not results.exists():
        _fail(f"{results} does not exist")
    problems: list[str] = []
    df = status_table(results, problems)
    for problem in problems:
        _warn(f"ignoring {problem}")
    if df.empty:
        console.print(Text(f"no records under {results}"))
        return
    console.print(_table(df, title=f"records under {results}"))
    for row in df.itertuples(index=False):
        if row.missing == 0:
            console.print(Text(f"{row.spec}: all {row.expected} cells recorded; a sweep would run nothing"))
        elif row.missing is not None and not pd.isna(row.missing):
            console.print(
                Text(f"{row.spec}: {row.missing} of {row.expected} cells missing; a sweep would run them")
            )


@app.command()
def collect(
    results: Annotated[Path, typer.Argument(help="results folder")],
    output: Annotated[Path, typer.Option("-o", "--output", help="collected Parquet file")],
) -> None:
    """Concatenate every record under RESULTS into one Parquet table (written outside any results folder)."""
    from harness.records import collect as collect_records
    from harness.records import write_table
    from harness.safe_fs import is_inside
    from harness.sweep import results_tree_of

    if not results.exists():
        _fail(f"{results} does not exist")
    tree = results if is_inside(output, results) else results_tree_of(output)
    if tree is not None:
        _fail(
            f"-o {output}: inside the results folder {tree}, where it could replace a record or be read as one; "
            "write the collected table elsewhere (e.g. -o all.parquet)"
        )
    problems: list[str] = []
    df = collect_records(results, exclude=[output], problems=problems)
    for problem in problems:
        _warn(f"ignoring {problem}")
    try:
        write_table(df, output)
    except OSError as e:
        _fail(f"-o {output}: {e.strerror or e}")
    console.print(Text(f"{len(df)} rows ({df['cell_id'].nunique()} cells) -> {output}"))


def _render(kind: str, results: Path, out: Path) -> None:
    from harness.records import collect as collect_records

    problems: list[str] = []
    df = collect_records(results, problems=problems)
    for problem in problems:
        _warn(f"ignoring {problem}")
    if df.empty:
        _fail(f"no records under {results}; run `pf-bench sweep SPEC --out {results}` first")
    import harness.figures as figures
    from harness.rank_runner import alignment_rows

    out.mkdir(parents=True, exist_ok=True)
    df, table3 = alignment_rows(df)  # alignment cells' rows (Table 3) apart from the measurements
    alignment = results / ALIGNMENT_DIR  # rows written by `pf-bench align --out`
    if not table3.empty and alignment.is_dir():
        from harness.figures.tables import load_alignment

        written = load_alignment(alignment)
        if not written.empty and "parallel" not in written.columns:
            written["parallel"] = "single"
        table3 = pd.concat([written, table3], ignore_index=True)
    if kind == "figures":
        made = figures.render_all(df, out)
    elif not table3.empty:
        made = figures.render_tables(df, out, alignment=table3)
    elif alignment.is_dir():
        made = figures.render_tables(df, out, alignment=alignment)
    else:
        made = figures.render_tables(df, out)
    for path in made or []:
        console.print(Text(str(path)))
    console.print(Text(f"{kind}: {len(made or [])} written to {out}"))


@app.command()
def figures(
    results: Annotated[Path, typer.Option(help="results folder")] = Path("results"),
    out: Annotated[Path, typer.Option(help="figure folder")] = Path("results/figures"),
) -> None:
    """Render every figure whose records are present (from the records alone)."""
    _render("figures", results, out)


@app.command()
def tables(
    results: Annotated[Path, typer.Option(help="results folder")] = Path("results"),
    out: Annotated[Path, typer.Option(help="table folder")] = Path("results/figures"),
) -> None:
    """Render the paper's tables (markdown and LaTeX) from the records."""
    _render("tables", results, out)


@app.command()
def simulate(
    out: Annotated[Path, typer.Option(help="folder for the simulated records")] = Path(
        "results/claim1_cp_pp/simulated"
    ),
    validate: Annotated[
        Path | None,
        typer.Option(help="results folder whose measured CP/PP cells the simulator is checked against"),
    ] = None,
) -> None:
    """Claim 1's simulated records: the paper-scale Figure 6 panels (labelled simulated) and, with --validate,
    the simulator's predictions of measured CP/PP cells (per-layer costs profiled on this machine)."""
    from harness.records import collect as collect_records
    from harness.records import write_cell_records
    from harness.simulate_claim1 import paper_cp_records, paper_pp_records, validate_records

    rows = paper_pp_records() + paper_cp_records()
    # one file per cell: collect verifies that a file holds the cell it is named after
    paths = write_cell_records(out / "paper_scale", rows, root=out)
    console.print(Text(f"{len(rows)} simulated rows in {len(paths)} records under {out / 'paper_scale'}"))
    if validate is not None:
        df = collect_records(validate)
        checked = validate_records(df) if not df.empty else []
        if not checked:
            _fail(f"no measured CP/PP records under {validate} to check the simulator against")
        paths = write_cell_records(out / "validation", checked, root=out)
        console.print(
            Text(f"{len(checked)} validation rows in {len(paths)} records under {out / 'validation'}")
        )
        worst = max(r["sim_error"] for r in checked)
        console.print(f"simulator checked against {len(checked)} measured points; worst error {worst:.1%}")


def report_steps_for(steps: int) -> list[int]:
    """The paper's reported steps (1, 10, 20) that fall within ``steps``, plus the last step."""
    return sorted({s for s in (1, 10, 20) if s <= steps} | {steps})


@app.command()
def align(
    model: Annotated[str, typer.Option(help="TorchTitan model 'family:flavor'")] = "llama3:debugmodel",
    override: Annotated[list[str], typer.Option(help="ModelArgs override FIELD=VALUE (repeatable)")] = [],  # noqa: B006
    steps: Annotated[
        int, typer.Option(min=1, help="AdamW steps; reports steps 1/10/20 within it and the last")
    ] = 20,
    dtype: DType = DType.bf16,
    prefix_len: int = 96,
    suffix_len: int = 32,
    n: int = 4,
    layout: Layout = Layout.padded,
    microbatch: Annotated[
        int | None, typer.Option(min=1, help="responses per microbatch (default: all; controls need < n)")
    ] = None,
    ac: AC = AC.none,
    loss: Annotated[LossName, typer.Option(help="pg, or grpo (PPO-clip)")] = LossName.pg,
    seed: int = 0,
    dp_replicate: DpReplicate = 1,
    dp_shard: DpShard = 1,
    cp: Cp = 1,
    tp: Tp = 1,
    pp: Pp = 1,
    ep: Ep = 1,
    as_json: Annotated[
        bool, typer.Option("--json", help="print one JSON object per row (the table goes to stderr)")
    ] = False,
    controls: Annotated[
        bool,
        typer.Option(
            "--controls/--no-controls",
            help="also train one PrefixFlow copy per injected fault (negative controls; each must FAIL)",
        ),
    ] = False,
    out: Annotated[
        Path | None, typer.Option(help=f"also write the rows to OUT/{ALIGNMENT_DIR}/ (read by `tables`)")
    ] = None,
) -> None:
    """Table 3: gradients (G), loss (L) and weights (W) of PrefixFlow vs the baseline over STEPS steps."""
    import torch

    from prefixflow.alignment import CONTROLS, CORRECT, AlignmentRow, format_alignment, run_alignment

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
    try:
        par = Parallel(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, ep=ep)
    except ValidationError as e:
        _fail("; ".join(x["msg"] for x in e.errors()))
    settings = dict(
        model=model,
        overrides=parse_overrides(override),
        steps=steps,
        report_steps=report_steps_for(steps),
        prefix_len=prefix_len,
        suffix_len=suffix_len,
        n=n,
        layout=layout.value,
        microbatch=microbatch,
        loss=loss.value,
        ac=ac.value,
        seed=seed,
    )
    try:
        if par != Parallel():
            from harness.launch import run_alignment_ranks
            from prefixflow.parallel import ParallelDims, check_supported

            check_supported(ParallelDims.of(par.model_dump()))
            if controls:
                raise ValueError("--controls runs on one process; drop the parallel flags to run them")
            rows = [AlignmentRow(**r) for r in run_alignment_ranks(par, {**settings, "dtype": dtype.value})]
        else:
            rows = run_alignment(**settings, dtype=dtypes[dtype.value], controls=CONTROLS if controls else ())
    except (ValueError, TypeError) as e:
        _fail(str(e))
    layout_cols = {**par.model_dump(), "parallel": par.label}
    if as_json:
        for r in rows:
            typer.echo(json.dumps(_json_safe({**r.as_dict(), **layout_cols})))
        err_console.print(Text(format_alignment(rows)), highlight=False)
    else:
        console.print(Text(format_alignment(rows)), highlight=False)
    if out is not None:
        import pandas as pd

        from harness.records import write_table
        from harness.runner import git_rev
        from harness.spec import safe_name

        table = pd.DataFrame([r.as_dict() for r in rows]).rename(columns={"passed": "pass"})
        table.insert(0, "model", model)
        table.insert(1, "layout", layout.value)
        table.insert(2, "microbatch", "all" if microbatch is None else str(microbatch))
        table.insert(3, "ac", ac.value)
        if par != Parallel():  # Table 3 rows carry their parallel layout
            table.insert(4, "parallel", par.label)
        table["git_rev"] = git_rev()
        name = f"{model}-{dtype.value}-{layout.value}-mb{microbatch or 'all'}-{ac.value}"
        if par != Parallel():
            name += f"-{par.label}"
        path = out / ALIGNMENT_DIR / f"{safe_name(name)}.parquet"
        (err_console if as_json else console).print(
            Text(f"alignment rows -> {write_table(table, path, root=out)}")
        )
    failed = False
    if not all(r.passed for r in rows if r.run == CORRECT):
        err_console.print(
            "[red]alignment FAILED: the paper's rule |x-y| <= tau_abs + tau_rel*max(|x|,|y|) or the normwise "
            "G bound[/red]"
        )
        failed = True
    blind = sorted({r.run for r in rows if r.run != CORRECT} - {r.run for r in rows if not r.passed})
    if blind:
        err_console.print(
            f"[red]negative control(s) {escape(str(blind))} PASSED: the check cannot see these faults[/red]"
        )
        failed = True
    if failed:
        raise typer.Exit(1)


def _register_subcommands() -> None:
    from harness.rl_cli import register as register_rl  # Claim 2: `rl` and `replay`

    register_rl(app)


_register_subcommands()

if __name__ == "__main__":
    app()
