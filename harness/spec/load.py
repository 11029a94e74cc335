"""Sweep specs (pydantic v2, loaded with a safe YAML loader) and their expansion into cells.

Specs are untrusted input: harness.spec.safe_yaml bounds the file and its alias expansion and rejects repeated
keys; model overrides and systems are resolved against their registries at load; a spec expands to at most
``max_cells`` cells (``--max-cells``); error messages show truncated input.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from harness.spec.cell import Cell, FrontierSearch
from harness.spec.checks import check_registries, describe_validation_error
from harness.spec.schema import Alignment, Axes, Frontier, Spec

__all__ = [
    "DEFAULT_MAX_CELLS",
    "PRESETS",
    "SpecError",
    "check_cell_count",
    "count_cells",
    "expand",
    "load_spec",
    "parse_spec",
    "read_spec_yaml",
    "safe_name",
]

PRESETS = ("cpu", "paper", "smoke")
DEFAULT_MAX_CELLS = 2_000


class SpecError(ValueError):
    """A spec could not be loaded; the message names the file, the field and what is allowed."""


def safe_name(text: str, max_len: int = 80) -> str:
    """Reduce ``text`` to [A-Za-z0-9._-]; never empty, never '.'/'..', never starting with '.'/'-'."""
    out = re.sub(r"[^A-Za-z0-9._-]+", "_", str(text)).strip("._-")[:max_len]
    return out or "unnamed"


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, val in over.items():
        if isinstance(val, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], val)
        else:
            out[key] = val
    return out


def parse_spec(raw: Any, source: str = "<spec>", preset: str = "cpu") -> Spec:
    """Validate a spec mapping, check every preset, and return it resolved for ``preset``."""
    if preset not in PRESETS:
        raise SpecError(f"{source}: unknown preset {preset!r}; allowed: {', '.join(PRESETS)}")
    if not isinstance(raw, dict):
        raise SpecError(
            f"{source}: top level must be a mapping with 'name' and 'axes', got {type(raw).__name__}"
        )
    try:
        base = Spec.model_validate(raw)
    except ValidationError as e:
        raise SpecError(describe_validation_error(e, source)) from None
    resolved, checked = base, [(base, source)]
    for name, body in base.presets.items():
        merged = _deep_merge({k: v for k, v in raw.items() if k != "presets"}, body)
        where = f"{source} (with preset '{name}' applied)"
        try:
            spec = Spec.model_validate(merged)
        except ValidationError as e:
            raise SpecError(describe_validation_error(e, where)) from None
        checked.append((spec, where))
        if name == preset:
            resolved = spec
    try:
        for block in resolved.axes_blocks:
            block.length_pairs()
    except ValueError as e:
        raise SpecError(f"{source}: axes: {e}") from None
    for spec, where in checked:
        try:
            check_registries(spec, where)
        except ValueError as e:
            raise SpecError(str(e)) from None
    return resolved


def read_spec_yaml(path: str | Path) -> Any:
    """The YAML document at ``path``, read as untrusted input (harness.spec.safe_yaml); SpecError on failure."""
    from harness.spec import safe_yaml

    try:
        return safe_yaml.load(safe_yaml.read_text(Path(path)))
    except OSError as e:
        raise SpecError(f"{path}: cannot read spec ({e.strerror})") from None
    except safe_yaml.YAMLInputError as e:
        raise SpecError(f"{path}: {e}") from None


def load_spec(path: str | Path, preset: str = "cpu") -> Spec:
    """Load a YAML spec as untrusted input (harness.spec.safe_yaml) and resolve it for ``preset``."""
    return parse_spec(read_spec_yaml(path), str(path), preset)


def count_cells(spec: Spec) -> int:
    """How many cells ``spec`` names (before duplicates are dropped), without building any."""
    total = sum(len(f.variants) for f in spec.frontier)
    for ax in spec.axes_blocks:
        pairs = (
            len(ax.lengths)
            if ax.lengths is not None
            else len(ax.trees)
            if ax.trees is not None
            else len(ax.vision)
            if ax.vision is not None
            else len(ax.total_len or []) * len(ax.prefix_ratio or [])
        )
        total += len(ax.models) * pairs * math.prod(len(_swept_values(ax, name)) for name in SWEPT)
    return total


def check_cell_count(spec: Spec, max_cells: int = DEFAULT_MAX_CELLS) -> int:
    """The number of cells ``spec`` names; more than ``max_cells`` is a SpecError (work is bounded)."""
    n = count_cells(spec)
    if n > max_cells:
        raise SpecError(
            f"spec '{spec.name}' expands to {n:,} cells, more than the cap of {max_cells:,}; "
            f"if you mean it, raise the cap with --max-cells {n}"
        )
    return n


def expand(spec: Spec, max_cells: int = DEFAULT_MAX_CELLS) -> list[Cell]:
    """One search cell per frontier block x variant, then the cartesian product of each axes block;
    duplicates (same id) are dropped, order is stable. More than ``max_cells`` is a SpecError."""
    check_cell_count(spec, max_cells)
    cells: dict[str, Cell] = {}
    for front in spec.frontier:  # first: a search is one long job, the short cells fill the other slots
        for cell in _frontier_cells(spec, front):
            cells.setdefault(cell.cell_id, cell)
    for i, ax in enumerate(spec.axes_blocks):
        for cell in _expand_block(spec, ax, "axes" if i == 0 else f"extra_axes.{i - 1}"):
            cells.setdefault(cell.cell_id, cell)
    for block in spec.alignment:
        for cell in _alignment_cells(spec, block):
            cells.setdefault(cell.cell_id, cell)
    return list(cells.values())


def _common(spec: Spec) -> dict[str, Any]:
    return {"spec": spec.name, "loss": spec.loss, "device": spec.device, "seed": spec.seed}


SWEPT = (
    "n", "suffix_spread", "layout", "microbatch", "memory_budget", "dtype", "compile", "ac", "offload",
    "parallel", "groups", "tower",
)  # fmt: skip


def _swept_values(ax: Axes, name: str) -> list:
    if name == "n" and ax.trees is not None:
        return [None]  # a tree cell's paths come from its shape
    return ax.layouts() if name == "parallel" else getattr(ax, name)


def _workloads(ax: Axes) -> list[tuple[tuple[int, int], Any]]:
    """((prefix_len, suffix_len), tree shape or None) of each length point of a block."""
    if ax.trees is not None:
        return [(shape.nominal()[:2], shape) for shape in ax.trees]
    if ax.vision is not None:
        return [(shape.nominal(), shape) for shape in ax.vision]
    return [(pair, None) for pair in ax.length_pairs()]


def _expand_block(spec: Spec, ax: Axes, where: str = "axes") -> list[Cell]:
    fixed = {
        **_common(spec),
        "systems": tuple(ax.systems or spec.systems),
        "warmup": spec.warmup if ax.warmup is None else ax.warmup,
        "repeats": spec.repeats if ax.repeats is None else ax.repeats,
        "timeout_min": spec.executor.timeout_min,
        "split_threshold": ax.split_threshold,
    }
    cells = []
    for model, ((p, s), shape), *values in itertools.product(
        ax.models, _workloads(ax), *(_swept_values(ax, name) for name in SWEPT)
    ):
        swept = dict(zip(SWEPT, values, strict=True))
        if swept["microbatch"] != "auto":
            swept["memory_budget"] = None  # a budget only sizes "auto" microbatches (duplicates are dropped)
        vision = shape if ax.vision is not None else None
        tree = shape if ax.trees is not None else None
        if tree is not None:
            swept["n"] = tree.nominal()[2]
        try:
            cells.append(
                Cell(**fixed, model=model, prefix_len=p, suffix_len=s, tree=tree, vision=vision, **swept)
            )
        except ValidationError as e:
            at = f"{where}.trees.{ax.trees.index(tree)}" if tree is not None else where
            at = f"{where}.vision.{ax.vision.index(vision)}" if vision is not None else at
            raise SpecError(describe_validation_error(e, f"spec '{spec.name}': {at}")) from None
    return cells


def _alignment_cells(spec: Spec, block: Alignment) -> list[Cell]:
    """One Table 3 run per dtype x layout x microbatch x AC x parallel layout (baseline and PrefixFlow)."""
    return [
        Cell(
            **_common(spec),
            model=block.model or spec.axes_blocks[0].models[0],
            prefix_len=block.prefix_len,
            suffix_len=block.suffix_len,
            n=block.n,
            layout=layout,
            microbatch=microbatch,
            dtype=dtype,
            ac=ac,
            parallel=parallel,
            groups=block.groups,
            systems=("baseline", "prefixflow"),
            warmup=0,
            repeats=1,
            timeout_min=block.timeout_min or spec.executor.timeout_min,
            alignment=block.settings(),
        )
        for dtype, layout, microbatch, ac, parallel in itertools.product(
            block.dtype, block.layout, block.microbatch, block.ac, block.parallel
        )
    ]


def search_cells(search: FrontierSearch, variants: Sequence[str], **fields: Any) -> list[Cell]:
    """One capacity-frontier search cell per variant (``SYSTEM``, or ``SYSTEM+offload`` for PrefixFlow with
    offload); its lengths are the search's first probe (``harness.run.frontier``). ``fields``: the cell's
    other fields (spec, model, n, layout, parallel ...)."""
    prefix, suffix = search.split(search.min_len)
    return [
        Cell(
            prefix_len=prefix,
            suffix_len=suffix,
            offload=variant.endswith("+offload"),
            systems=(variant.removesuffix("+offload"),),
            warmup=0,
            repeats=1,
            frontier=search,
            **fields,
        )
        for variant in variants
    ]


def _frontier_cells(spec: Spec, front: Frontier) -> list[Cell]:
    """A ``frontier:`` block's search cells (:func:`search_cells`), one per variant."""
    return search_cells(
        front.search(),
        front.variants,
        **_common(spec),
        model=front.model or spec.axes_blocks[0].models[0],
        n=front.n,
        layout=front.layout,
        microbatch=front.microbatch,
        dtype=front.dtype,
        ac=front.ac,
        parallel=front.parallel,
        timeout_min=front.timeout_min or spec.executor.timeout_min,
    )
