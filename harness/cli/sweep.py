"""``pf-bench sweep``, ``status`` and ``collect``: run a spec's missing cells, count and gather their records."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import pandas as pd
import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from harness.cli.common import ExecutorKind, Preset, _fail, _table, _warn, console, err_console
from harness.spec.cell import Cell
from harness.spec.load import DEFAULT_MAX_CELLS, SpecError, check_cell_count, expand, load_spec


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
    estimate: Annotated[
        bool,
        typer.Option(
            "--estimate",
            help="estimate each cell on fake tensors (as the spec's executor: {kind: estimate}; docs/estimate.md)",
        ),
    ] = False,
) -> None:
    """Run every missing cell of SPEC (resumable: recorded cells are skipped). Exits 1 if a cell failed."""
    from harness.execute.executors import make_executor
    from harness.run.memory import check_cell_sequences
    from harness.safe_fs import UnsafePathError, check_writable, jobs_folder
    from harness.sweep import plan, run_sweep, spec_folder

    s = _load(spec, preset)
    try:
        check_cell_count(s, max_cells)
    except SpecError as e:
        _fail(str(e))
    try:  # every cell's sequences against its model's positions, from meta-device builds, before any work
        check_cell_sequences(expand(s, max_cells=max_cells))
    except ValueError as e:
        _fail(f"{spec}: {e}")
    estimate = estimate or s.executor.kind == "estimate"
    if dry_run:
        try:  # SpecError, or a folder holding records of the other kind (estimated, measured)
            p = plan(s, out, retry_failed, max_cells, estimate=estimate)
        except ValueError as e:
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
    if estimate and executor is ExecutorKind.slurm:
        _fail(
            "--executor slurm: estimates run on this machine; use --executor local or debug with --estimate"
        )
    try:
        if estimate and executor is ExecutorKind.debug:
            from harness.execute.executors import DebugExecutor

            ex = DebugExecutor(estimate=True)
        else:
            ex = make_executor("estimate" if estimate else executor.value, s.executor, max_jobs)
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
                    f"{len(p.todo)} to run ({executor.value}{', estimated' if estimate else ''}) -> {p.folder}"
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
    shown = df.astype(object).where(df.notna(), None)  # a spec without a manifest has no expected count: "-"
    console.print(_table(shown, title=f"records under {results} (cells by status; systems and rows apart)"))
    for row in shown.itertuples(index=False):
        if row.missing == 0:
            console.print(Text(f"{row.spec}: all {row.expected} cells recorded; a sweep would run nothing"))
        elif row.missing is not None:
            console.print(
                Text(f"{row.spec}: {row.missing} of {row.expected} cells missing; a sweep would run them")
            )


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
