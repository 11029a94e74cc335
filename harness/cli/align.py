"""``pf-bench align``: Table 3, PrefixFlow's gradients, loss and weights against the baseline's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.markup import escape
from rich.text import Text

from harness.cli.common import (
    AC,
    ALIGNMENT_DIR,
    Cp,
    DpReplicate,
    DpShard,
    DType,
    Ep,
    Layout,
    LossName,
    Pp,
    Tp,
    _fail,
    _json_safe,
    console,
    err_console,
    parse_overrides,
)
from harness.spec.cell import Parallel, report_steps_for


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
    device: Annotated[str, typer.Option(help="auto | cpu | cuda (auto: CUDA when there is one)")] = "auto",
) -> None:
    """Table 3: gradients (G), loss (L) and weights (W) of PrefixFlow vs the baseline over STEPS steps."""
    import torch

    from prefixflow.checks.alignment import CONTROLS, CORRECT, AlignmentRow, format_alignment, run_alignment

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
    try:
        par = Parallel(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, ep=ep)
    except ValidationError as e:
        _fail("; ".join(x["msg"] for x in e.errors()))
    if device not in ("auto", "cpu", "cuda"):
        _fail(f"--device {device!r}: use auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        _fail("--device cuda: torch sees no CUDA device here")
    if device != "auto" and par != Parallel():
        _fail("--device applies to one process; parallel ranks use CUDA when there is one, else the CPU")
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
            from harness.execute.local import run_alignment_ranks
            from prefixflow.parallel import ParallelDims, check_supported

            check_supported(ParallelDims.of(par.model_dump()))
            if controls:
                raise ValueError("--controls runs on one process; drop the parallel flags to run them")
            rows = [AlignmentRow(**r) for r in run_alignment_ranks(par, {**settings, "dtype": dtype.value})]
        else:
            from harness.run.setup import resolve_device

            rows = run_alignment(
                **settings,
                dtype=dtypes[dtype.value],
                controls=CONTROLS if controls else (),
                device=resolve_device(device),
            )
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
        from harness.run.columns import git_rev
        from harness.spec.load import safe_name

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
    if controls:
        err_console.print(
            Text(
                f"negative controls: every injected fault ({', '.join(sorted({r.run for r in rows} - {CORRECT}))}) "
                "FAILs, as it must (each row FAIL is expected: the check sees the fault); the correct run passes"
            ),
            highlight=False,
        )
