"""The capacity frontier at any scale, estimated: does a shape fit a memory budget, and what is the largest
total length that fits (``pf-bench frontier``, the notebook's first tab; docs/estimate.md, "Frontier").

Each variant (a system, ``+offload`` for PrefixFlow with offload) is one capacity-frontier search cell
(``harness.run.frontier``) whose probes are estimated on fake tensors (``harness.estimate.cell``): the peak
is the rank-max of every phase's live bytes, and a probe fits when it is within the budget. The searches
run in estimate worker processes (``harness.execute.executors.EstimateExecutor``), ``jobs`` at a time, and
keep every probe under ``OUT/frontier/_probes/``, so an interrupted search resumes where it stopped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import pandas as pd

from harness.spec.cell import Cell, FrontierSearch, ModelSpec, Parallel
from harness.spec.load import search_cells

__all__ = ["FRONTIER_SPEC", "parse_size", "frontier_cells", "search_frontier"]

FRONTIER_SPEC = "frontier"  # the records' spec name and their folder under OUT
_SIZE = re.compile(r"^\s*([0-9]{1,20}(?:\.[0-9]{1,20})?)\s*([A-Za-z]{0,3})\s*$")
_UNITS = {"": 1, "B": 1} | {
    name: base**power
    for power, letter in enumerate("KMGT", start=1)
    for name, base in ((letter, 1024), (f"{letter}IB", 1024), (f"{letter}B", 1000))
}


def parse_size(text: str | int) -> int:
    """Bytes of a memory size: an integer, or a number with a unit (``96GiB``, ``80G``, ``512MiB``; K/M/G/T
    and KiB/MiB/GiB/TiB are binary, as GPU memory is quoted; KB/MB/GB/TB decimal; up to 20 ASCII digits
    either side of the point, rounded down to a byte). Raises ValueError for anything else, and for a size
    below one byte or above 2**62."""
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    else:
        m = _SIZE.match(str(text))
        if m is None or m.group(2).upper() not in _UNITS:
            raise ValueError(
                f"{text!r:.60} is not a size: give bytes or a number with a unit (96GiB, 80G, 512MiB)"
            )
        size = int(Fraction(m.group(1)) * _UNITS[m.group(2).upper()])  # exact: no float rounding or overflow
    if not 1 <= size <= 2**62:
        raise ValueError(f"{text!r:.60} is not a positive size (1 byte to 2**62 bytes)")
    return size


def frontier_cells(
    model: ModelSpec,
    search: FrontierSearch,
    variants: Sequence[str] = ("baseline", "prefixflow+offload"),
    parallel: Parallel | None = None,
    timeout_min: float = 120.0,
    **fields: Any,
) -> list[Cell]:
    """One search cell per variant, as a spec's ``frontier:`` block makes them (``search_cells``; ``fields``:
    ``n``, ``microbatch``, ``dtype``, ``ac``, ``layout``, ``loss``, ``seed``). Raises pydantic's
    ValidationError for a bad field."""
    return search_cells(
        search, variants, spec=FRONTIER_SPEC, model=model, parallel=parallel or Parallel(), device="cpu",
        timeout_min=timeout_min, **fields,
    )  # fmt: skip


def search_frontier(
    cells: Sequence[Cell], out: str | Path, jobs: int = 1, on_done: Callable[[Cell, str], None] | None = None
) -> pd.DataFrame:
    """Run the estimated searches of ``cells`` into ``OUT/frontier/`` (``jobs`` worker processes) and return
    every probe's row (``harness.figures.frontier_table`` reads them). A probe that could not be estimated
    is a row with its status and error; the search it belongs to stops there."""
    from harness.execute.executors import EstimateExecutor
    from harness.execute.outcome import record_path
    from harness.records import read_records
    from harness.safe_fs import open_dir
    from harness.sweep import spec_folder, sweep_lock

    folder = spec_folder(out, FRONTIER_SPEC)
    with open_dir(folder, Path(out)):  # created, and not a link planted in OUT
        pass
    with sweep_lock(folder):
        EstimateExecutor(max_jobs=jobs).run(list(cells), folder, on_done or (lambda cell, status: None))
    frames = [read_records(record_path(folder, cell)) for cell in cells]
    return pd.concat(frames, ignore_index=True)
