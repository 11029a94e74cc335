"""``pf-bench``: the harness command line (thin: parse, call, print).

The Typer app; each command lives in its module (``run``, ``sweep``, ``figures``, ``align``, ``workload``, ``frontier``,
``rl``) and
is registered here in the order ``--help`` lists them.
"""

from __future__ import annotations

import typer

from harness.cli.align import align
from harness.cli.figures import figures, simulate, tables
from harness.cli.frontier import frontier
from harness.cli.rl import register as register_rl
from harness.cli.run import run
from harness.cli.sweep import collect, status, sweep
from harness.cli.workload import workload

__all__ = ["app"]

app = typer.Typer(
    help="PrefixFlow benchmark harness: specs -> cells -> records -> figures.",
    no_args_is_help=True,
    add_completion=False,
)

for command in (run, sweep, status, collect, figures, tables, simulate, align, workload, frontier):
    app.command()(command)
register_rl(app)  # Claim 2: `rl` and `replay`
