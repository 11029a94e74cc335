"""What every ``pf-bench`` command shares: the consoles, one-line user errors, option types and Rich tables."""

from __future__ import annotations

import math
import sys
from enum import StrEnum
from typing import Annotated, Any, NoReturn

import pandas as pd
import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

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
    smoke = "smoke"


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


def _int_or_text(value: str | None):
    """An option that is an int or a keyword (``auto``, ``peak:SYSTEM``)."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return value


def _flags_without_type() -> None:
    """Typer 0.29 prints ``<bool>`` beside every flag in ``--help`` (``--json <bool>``), which reads as if the
    flag took a value; a flag (``--help`` too) shows no type."""
    from typer.core import TyperOption

    shown = TyperOption.display_type_rich
    if getattr(shown, "_pf_flags", False):
        return

    def display_type_rich(self, ctx):
        return None if self.is_flag else shown(self, ctx)

    display_type_rich._pf_flags = True
    TyperOption.display_type_rich = display_type_rich


_flags_without_type()
