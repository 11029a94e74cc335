"""``pf-bench figures``, ``tables`` and ``simulate``: render the paper's figures and tables from the records,
and write Claim 1's simulated records."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import pandas as pd
import typer
from rich.text import Text

from harness.cli.common import ALIGNMENT_DIR, _fail, _warn, console


def _render(kind: str, results: Path, out: Path) -> None:
    from harness.records import collect as collect_records

    problems: list[str] = []
    df = collect_records(results, problems=problems)
    for problem in problems:
        _warn(f"ignoring {problem}")
    if df.empty:
        _fail(f"no records under {results}; run `pf-bench sweep SPEC --out {results}` first")
    import harness.figures as figures
    from harness.run.alignment import alignment_rows

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


def figures(
    results: Annotated[Path, typer.Option(help="results folder")] = Path("results"),
    out: Annotated[Path, typer.Option(help="figure folder")] = Path("results/figures"),
) -> None:
    """Render every figure whose records are present (from the records alone)."""
    _render("figures", results, out)


def tables(
    results: Annotated[Path, typer.Option(help="results folder")] = Path("results"),
    out: Annotated[Path, typer.Option(help="table folder")] = Path("results/figures"),
) -> None:
    """Render the paper's tables (markdown and LaTeX) from the records."""
    _render("tables", results, out)


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
    the simulator's predictions of measured CP/PP cells (each from costs calibrated on another measured run)."""
    from harness.records import collect as collect_records
    from harness.records import write_cell_records
    from harness.simulate.claim1 import paper_cp_records, paper_pp_records
    from harness.simulate.validate import validate_records

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
        for r in checked:
            console.print(Text(f"  {r['system']} pp={r['pp']} cp={r['cp']} n={r['n']} {r['quantity']}: "
                               f"measured {r['measured_s']:.3f} s, predicted {r['predicted_s']:.3f} s, "
                               f"error {r['sim_error']:.1%} (calibrated on {r['calibrated_on']})"))  # fmt: skip
        worst = max(r["sim_error"] for r in checked)
        console.print(f"simulator checked against {len(checked)} measured points; worst error {worst:.1%}")
