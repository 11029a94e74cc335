"""Sweep specs (pydantic v2, loaded with a safe YAML loader) and their expansion into cells.

Specs are untrusted input: harness.safe_yaml bounds the file and its alias expansion and rejects repeated
keys; model overrides and systems are resolved against their registries at load; a spec expands to at most
``max_cells`` cells (``--max-cells``); error messages show truncated input.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from harness.spec_checks import check_registries, describe_validation_error

PRESETS = ("cpu", "paper")
SYSTEM_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
PEAK_OF = re.compile(r"^peak:([a-z][a-z0-9_]*)$")  # a memory budget: the measured peak of another system
MemoryBudget = int | str | None
OverrideValue = int | float | bool | str
NOT_IDENTITY = ("spec", "timeout_min")  # cell fields that do not change what is measured
DEFAULT_MAX_CELLS = 2_000
MAX_INT = 2**31 - 1  # lengths, counts and repeats (records store int64)
Seed = Annotated[int, Field(ge=0, le=2**32 - 1, description="random seed, 0 .. 2**32-1")]
Count = Annotated[int, Field(ge=1, le=MAX_INT)]
TIMEOUT_MAX_MIN = 60 * 24 * 365


class SpecError(ValueError):
    """A spec could not be loaded; the message names the file, the field and what is allowed."""


def safe_name(text: str, max_len: int = 80) -> str:
    """Reduce ``text`` to [A-Za-z0-9._-]; never empty, never '.'/'..', never starting with '.'/'-'."""
    out = re.sub(r"[^A-Za-z0-9._-]+", "_", str(text)).strip("._-")[:max_len]
    return out or "unnamed"


def _check_systems(v: list[str]) -> list[str]:
    for s in v:
        if not SYSTEM_NAME.fullmatch(s):
            raise ValueError(f"system name {s!r} must match {SYSTEM_NAME.pattern}")
    if len(set(v)) != len(v):
        raise ValueError(f"systems {v} contain duplicates")
    return v


def _sizes_microbatches(system: str) -> bool:
    """Whether ``system`` splits its suffixes into microbatches (so ``auto`` sizes them by the budget)."""
    from harness.systems import get_system

    try:
        return getattr(get_system(system), "library_system", None) is not None
    except ValueError:  # an unknown name is reported by the registry check
        return False


def _check_budget(x) -> None:
    if x is None or (isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= 2**62):
        return
    if isinstance(x, str) and PEAK_OF.fullmatch(x):
        return
    raise ValueError(f"memory_budget {x!r} must be null, bytes >= 1, or 'peak:SYSTEM'")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ModelSpec(_Strict):
    """A model plus config overrides: TorchTitan ``family:flavor`` (ModelArgs fields), or a Hugging Face
    ``hf:<built-in config name | local config.json path>`` (config fields; needs ``prefixflow[hf]``)."""

    name: str = Field(
        pattern=r"^([A-Za-z0-9_.-]+:[A-Za-z0-9_.-]+|hf:[A-Za-z0-9_./~-]{1,500})$",
        description="family:flavor, or hf:<config name or local config path>",
    )
    overrides: dict[str, OverrideValue] = Field(default_factory=dict)
    label: str | None = None

    @field_validator("overrides")
    @classmethod
    def _override_keys(cls, v: dict[str, OverrideValue]) -> dict[str, OverrideValue]:
        for key in v:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise ValueError(f"override key {key!r} is not an identifier (a ModelArgs field name)")
        return v

    @property
    def display(self) -> str:
        return self.label or self.name


PARALLEL_DIMS = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")  # TorchTitan's mesh names


class Parallel(_Strict):
    """Parallel layout of one cell, in TorchTitan's mesh names (prefixflow.parallel.ParallelDims)."""

    dp_replicate: int = Field(1, ge=1, description="data-parallel replicas (gradients all-reduced)")
    dp_shard: int = Field(1, ge=1, description="FSDP2 ranks (parameters sharded, gradients reduce-scattered)")
    cp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "dp" in data:
            raise ValueError(
                "'dp' is now two of TorchTitan's dimensions: 'dp_replicate' (replicas, gradients all-reduced) "
                "or 'dp_shard' (FSDP2); rename it to one of them"
            )
        return data

    @property
    def world_size(self) -> int:
        """Ranks the layout needs (expert parallelism borrows ranks, as in TorchTitan)."""
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def batch(self) -> int:
        """Data-parallel degree: ranks that train different groups."""
        return self.dp_replicate * self.dp_shard

    @property
    def label(self) -> str:
        parts = [f"{n}{getattr(self, n)}" for n in PARALLEL_DIMS if getattr(self, n) > 1]
        return "-".join(parts) or "single"

    def identity(self) -> dict[str, int]:
        """The layout as it enters a cell id: single-device and TP/CP/PP/EP-only layouts keep the form
        they had before the data-parallel dimensions were split (their recorded cells stay valid)."""
        if self.batch == 1:
            return {"cp": self.cp, "dp": 1, "ep": self.ep, "pp": self.pp, "tp": self.tp}
        return self.model_dump()


class LengthPair(_Strict):
    prefix: int = Field(ge=1, le=MAX_INT)
    suffix: int = Field(ge=1, le=MAX_INT)


class Axes(_Strict):
    """The swept axes; their cartesian product is the set of cells."""

    models: list[ModelSpec] = Field(min_length=1)
    lengths: list[LengthPair] | None = Field(None, min_length=1, description="explicit prefix/suffix")
    prefix_ratio: list[float] | None = Field(None, min_length=1)
    total_len: list[Count] | None = Field(None, min_length=1)
    n: list[Count] = Field(min_length=1)
    suffix_spread: list[float] = Field(default_factory=lambda: [0.0], min_length=1)
    layout: list[Literal["padded", "packed"]] = Field(default_factory=lambda: ["padded"], min_length=1)
    microbatch: list[Count | Literal["auto"] | None] = Field(default_factory=lambda: [None], min_length=1)
    memory_budget: list[MemoryBudget] = Field(
        default_factory=lambda: [None],
        min_length=1,
        description="microbatch 'auto' only: bytes, or 'peak:SYSTEM' (that system's measured peak in the cell)",
    )
    dtype: list[Literal["fp32", "bf16", "fp64"]] = Field(default_factory=lambda: ["fp32"], min_length=1)
    compile: list[bool] = Field(default_factory=lambda: [False], min_length=1)
    ac: list[Literal["selective", "full", "none"]] = Field(default_factory=lambda: ["none"], min_length=1)
    offload: list[bool] = Field(default_factory=lambda: [False], min_length=1)
    parallel: list[Parallel] = Field(default_factory=lambda: [Parallel()], min_length=1)
    # or one axis per TorchTitan dimension (their product gives the layouts), e.g. tp: [1, 2]
    dp_replicate: list[int] | None = Field(None, min_length=1)
    dp_shard: list[int] | None = Field(None, min_length=1)
    cp: list[int] | None = Field(None, min_length=1)
    tp: list[int] | None = Field(None, min_length=1)
    pp: list[int] | None = Field(None, min_length=1)
    ep: list[int] | None = Field(None, min_length=1)
    groups: list[int | None] = Field(
        default_factory=lambda: [None], min_length=1, description="groups per step (null: one per DP rank)"
    )
    split_threshold: float | None = Field(
        0.25, ge=0, description="split a group when the busiest DP rank exceeds the mean load by this"
    )
    # per-block overrides of the spec's settings (a spec may list several axes blocks)
    systems: list[str] | None = Field(None, min_length=1, description="systems of this block only")
    warmup: int | None = Field(None, ge=0, le=MAX_INT)
    repeats: int | None = Field(None, ge=1, le=MAX_INT)

    @field_validator("prefix_ratio")
    @classmethod
    def _ratios(cls, v: list[float] | None) -> list[float] | None:
        for r in v or []:
            if not 0.0 < r < 1.0:
                raise ValueError(f"prefix_ratio {r} must be strictly between 0 and 1")
        return v

    @field_validator("total_len", "n")
    @classmethod
    def _positive(cls, v: list[int] | None) -> list[int] | None:
        for x in v or []:
            if x < 1:
                raise ValueError(f"{x} must be >= 1")
        return v

    @field_validator("microbatch")
    @classmethod
    def _microbatch(cls, v: list) -> list:
        for x in v:
            if x is not None and x != "auto" and x < 1:
                raise ValueError(f"microbatch {x} must be >= 1, null (whole group) or 'auto'")
        return v

    @field_validator("memory_budget")
    @classmethod
    def _memory_budget(cls, v: list[MemoryBudget]) -> list[MemoryBudget]:
        for x in v:
            _check_budget(x)
        return v

    @field_validator("suffix_spread")
    @classmethod
    def _spread(cls, v: list[float]) -> list[float]:
        for x in v:
            if not 0.0 <= x < 1.0:
                raise ValueError(f"suffix_spread {x} must be in [0, 1)")
        return v

    @field_validator(*PARALLEL_DIMS)
    @classmethod
    def _degrees(cls, v: list[int] | None) -> list[int] | None:
        for x in v or []:
            if x < 1:
                raise ValueError(f"parallel degree {x} must be >= 1")
        return v

    @field_validator("groups")
    @classmethod
    def _groups(cls, v: list[int | None]) -> list[int | None]:
        for x in v:
            if x is not None and x < 1:
                raise ValueError(f"groups {x} must be >= 1 or null (one per data-parallel rank)")
        return v

    @model_validator(mode="after")
    def _one_parallel_form(self) -> Axes:
        per_dim = [d for d in PARALLEL_DIMS if getattr(self, d) is not None]
        if per_dim and "parallel" in self.model_fields_set:
            raise ValueError(
                f"give either 'parallel' (a list of layouts) or per-dimension axes {per_dim}, not both"
            )
        return self

    def layouts(self) -> list[Parallel]:
        """The parallel layouts of this block: the explicit list, or the product of the per-dimension axes."""
        if all(getattr(self, d) is None for d in PARALLEL_DIMS):
            return list(self.parallel)
        axes = [getattr(self, d) or [1] for d in PARALLEL_DIMS]
        return [
            Parallel(**dict(zip(PARALLEL_DIMS, combo, strict=True))) for combo in itertools.product(*axes)
        ]

    @model_validator(mode="after")
    def _one_length_form(self) -> Axes:
        ratio_form = self.prefix_ratio is not None or self.total_len is not None
        if self.lengths is not None and ratio_form:
            raise ValueError("give either 'lengths' or 'prefix_ratio' x 'total_len', not both")
        if self.lengths is None and (self.prefix_ratio is None or self.total_len is None):
            raise ValueError(
                "give 'lengths' (list of {prefix, suffix}) or both 'prefix_ratio' and 'total_len'"
            )
        return self

    def length_pairs(self) -> list[tuple[int, int]]:
        if self.lengths is not None:
            return [(p.prefix, p.suffix) for p in self.lengths]
        pairs = []
        for total in self.total_len or []:
            for r in self.prefix_ratio or []:
                prefix = round(r * total)
                if prefix < 1 or prefix >= total:
                    raise ValueError(f"prefix_ratio {r} x total_len {total} leaves an empty prefix or suffix")
                pairs.append((prefix, total - prefix))
        return pairs


class ExecutorSettings(_Strict):
    """Where and how cells run; Slurm keys are ignored by the local and debug executors."""

    max_jobs: int = Field(
        2, ge=1, le=10_000, description="concurrent cells (local) / array parallelism (slurm)"
    )
    timeout_min: float = Field(10.0, gt=0, le=TIMEOUT_MAX_MIN, description="per-cell limit in minutes")
    partition: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    nodes: int = Field(1, ge=1, le=MAX_INT)
    gpus_per_node: int = Field(0, ge=0, le=MAX_INT)
    cpus_per_task: int = Field(1, ge=1, le=MAX_INT)
    mem_gb: float = Field(4.0, gt=0, le=2**40)
    overcommit: bool = Field(
        False, description="Slurm --overcommit for multi-rank cells: more ranks than CPUs (small CPU nodes)"
    )


class FrontierSearch(_Strict):
    """What one capacity-frontier search needs besides the cell (resolved; see harness.frontier)."""

    budget_bytes: int | None = Field(None, ge=1, le=2**62, description="None = the device itself (CUDA only)")
    mode: Literal["ratio", "prefix"]
    ratio: float | None = Field(None, gt=0.0, lt=1.0, description="prefix ratio (mode ratio)")
    prefix_len: int | None = Field(None, ge=1, le=MAX_INT, description="fixed prefix (mode prefix)")
    min_len: int = Field(ge=2, le=MAX_INT, description="searched length: P+S (ratio) or S (prefix)")
    max_len: int = Field(ge=2, le=MAX_INT)
    resolution: int = Field(ge=1, le=MAX_INT, description="the search stops when the bracket is this narrow")

    @model_validator(mode="after")
    def _consistent(self) -> FrontierSearch:
        if self.mode == "ratio" and (self.ratio is None or self.prefix_len is not None):
            raise ValueError("mode 'ratio' needs 'ratio' (and no 'prefix_len')")
        if self.mode == "prefix" and (self.prefix_len is None or self.ratio is not None):
            raise ValueError("mode 'prefix' needs 'prefix_len' (and no 'ratio')")
        if self.max_len < self.min_len:
            raise ValueError(f"max_len {self.max_len} < min_len {self.min_len}")
        return self


class Frontier(FrontierSearch):
    """A ``frontier:`` block: the search settings plus the fixed configuration and the variants."""

    variants: list[str] = Field(
        default_factory=lambda: ["baseline", "prefixflow", "prefixflow+offload"], min_length=1
    )
    model: ModelSpec | None = Field(None, description="default: the first model of the first axes block")
    n: Count
    layout: Literal["padded", "packed"] = "padded"
    microbatch: Count | None = None
    dtype: Literal["fp32", "bf16", "fp64"] = "fp32"
    ac: Literal["selective", "full", "none"] = "none"
    timeout_min: float | None = Field(
        None, gt=0, le=TIMEOUT_MAX_MIN, description="per search; default: the executor's"
    )

    @field_validator("variants")
    @classmethod
    def _variants(cls, v: list[str]) -> list[str]:
        for name in v:
            if not SYSTEM_NAME.fullmatch(name.removesuffix("+offload")):
                raise ValueError(f"variant {name!r} must be a system name, optionally with '+offload'")
        return v

    def search(self) -> FrontierSearch:
        return FrontierSearch.model_validate(self.model_dump(include=set(FrontierSearch.model_fields)))


class AlignmentSettings(_Strict):
    """What an alignment cell (Table 3) needs besides the cell: AdamW steps and learning rate."""

    steps: int = Field(20, ge=1, description="AdamW steps; rows at steps 1, 10, 20 within them and the last")
    lr: float = Field(1e-5, gt=0)


class Alignment(AlignmentSettings):
    """An ``alignment:`` block: Table 3 (G/L/W of PrefixFlow vs the baseline) for each dtype x layout x
    microbatch x AC x parallel layout; both systems run in the same layout."""

    model: ModelSpec | None = Field(None, description="default: the first model of the first axes block")
    dtype: list[Literal["fp32", "bf16", "fp64"]] = Field(default_factory=lambda: ["bf16"], min_length=1)
    prefix_len: int = Field(96, ge=1)
    suffix_len: int = Field(32, ge=1)
    n: int = Field(4, ge=1)
    layout: list[Literal["padded", "packed"]] = Field(default_factory=lambda: ["padded"], min_length=1)
    microbatch: list[int | None] = Field(default_factory=lambda: [None], min_length=1)
    ac: list[Literal["selective", "full", "none"]] = Field(default_factory=lambda: ["none"], min_length=1)
    parallel: list[Parallel] = Field(default_factory=lambda: [Parallel()], min_length=1)
    groups: int | None = Field(None, ge=1, description="groups per step (null: one per data-parallel rank)")
    timeout_min: float | None = Field(None, gt=0, description="per cell; default: the executor's")

    def settings(self) -> AlignmentSettings:
        return AlignmentSettings(steps=self.steps, lr=self.lr)


class Spec(_Strict):
    """A sweep: axes x systems, with measurement and executor settings."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,79}$")
    description: str = ""
    systems: list[str] = Field(default_factory=lambda: ["baseline", "prefixflow"], min_length=1)
    loss: Literal["pg", "grpo"] = "pg"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: Seed = 0
    warmup: int = Field(1, ge=0, le=MAX_INT)
    repeats: int = Field(3, ge=1, le=MAX_INT)
    axes: Axes
    extra_axes: list[Axes] = Field(default_factory=list, description="more blocks; cells are the union")
    frontier: list[Frontier] = Field(default_factory=list, description="capacity-frontier searches")
    alignment: list[Alignment] = Field(default_factory=list, description="Table 3 runs (alignment cells)")
    executor: ExecutorSettings = Field(default_factory=ExecutorSettings)
    presets: dict[Literal["cpu", "paper"], dict[str, Any]] = Field(default_factory=dict)

    @field_validator("systems")
    @classmethod
    def _systems(cls, v: list[str]) -> list[str]:
        return _check_systems(v)

    @model_validator(mode="after")
    def _block_systems(self) -> Spec:
        for block in self.axes_blocks:
            _check_systems(block.systems or [])
        return self

    @property
    def axes_blocks(self) -> list[Axes]:
        return [self.axes, *self.extra_axes]

    @field_validator("presets")
    @classmethod
    def _no_nested_presets(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for key, body in v.items():
            if "presets" in body:
                raise ValueError(f"preset {key!r} may not itself contain 'presets'")
        return v


class Cell(_Strict):
    """One resolved point of a sweep; runs every system of the spec on identical inputs."""

    spec: str
    model: ModelSpec
    prefix_len: int = Field(ge=1, le=MAX_INT)
    suffix_len: int = Field(ge=1, le=MAX_INT)
    n: Count
    suffix_spread: float = 0.0
    layout: Literal["padded", "packed"] = "padded"
    microbatch: Count | Literal["auto"] | None = None
    memory_budget: MemoryBudget = None  # microbatch "auto": bytes, or "peak:SYSTEM" measured in the cell
    dtype: Literal["fp32", "bf16", "fp64"] = "fp32"
    compile: bool = False
    ac: Literal["selective", "full", "none"] = "none"
    offload: bool = False
    parallel: Parallel = Field(default_factory=Parallel)
    groups: int | None = Field(None, ge=1, description="groups per step; None: one per data-parallel rank")
    split_threshold: float | None = Field(0.25, ge=0)
    systems: tuple[str, ...] = Field(("baseline", "prefixflow"), min_length=1)
    loss: Literal["pg", "grpo"] = "pg"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: Seed = 0
    warmup: int = Field(1, ge=0, le=MAX_INT)
    repeats: int = Field(3, ge=1, le=MAX_INT)
    timeout_min: float = Field(10.0, gt=0, le=TIMEOUT_MAX_MIN)
    frontier: FrontierSearch | None = None  # set: this cell is a capacity-frontier search (harness.frontier)
    alignment: AlignmentSettings | None = None  # set: this cell is a Table 3 run (harness.rank_runner)

    @field_validator("systems")
    @classmethod
    def _systems(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(_check_systems(list(v)))

    @model_validator(mode="after")
    def _budget_fits_microbatch(self) -> Cell:
        _check_budget(self.memory_budget)
        if (self.microbatch == "auto") != (self.memory_budget is not None):
            raise ValueError(
                "microbatch 'auto' needs a memory_budget, and a memory_budget needs microbatch 'auto'"
            )
        peer = PEAK_OF.fullmatch(self.memory_budget) if isinstance(self.memory_budget, str) else None
        if peer and peer.group(1) not in self.systems:
            raise ValueError(f"memory_budget {self.memory_budget!r} names a system the cell does not run")
        if peer and _sizes_microbatches(peer.group(1)):
            raise ValueError(
                f"memory_budget {self.memory_budget!r}: {peer.group(1)} itself runs microbatch 'auto' under the "
                f"budget; name a system that does not (e.g. peak:prefix_grouper) or give bytes"
            )
        if self.microbatch == "auto" and (self.world_size > 1 or self.groups_per_step > 1):
            raise ValueError(
                f"microbatch 'auto' runs on one process with one group per step; this cell's layout is "
                f"{self.parallel.label} with {self.groups_per_step} groups: use a fixed microbatch"
            )
        return self

    @property
    def cell_id(self) -> str:
        skip = set(NOT_IDENTITY) | ({"frontier"} if self.frontier is None else set())
        skip |= {"alignment"} if self.alignment is None else set()
        skip |= {"memory_budget"} if self.memory_budget is None else set()  # ids of earlier cells unchanged
        ident = self.model_dump(mode="json", exclude=skip)
        # Layout fields enter the id only where they matter, so cells recorded before they existed keep it.
        ident["parallel"] = self.parallel.identity()
        if self.parallel.batch == 1 and self.groups is None:
            ident.pop("groups")
            ident.pop("split_threshold")
        blob = json.dumps(ident, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def groups_per_step(self) -> int:
        return self.groups or self.parallel.batch

    @property
    def prefix_ratio(self) -> float:
        return self.prefix_len / (self.prefix_len + self.suffix_len)


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
    """The YAML document at ``path``, read as untrusted input (harness.safe_yaml); SpecError on failure."""
    from harness import safe_yaml

    try:
        return safe_yaml.load(safe_yaml.read_text(Path(path)))
    except OSError as e:
        raise SpecError(f"{path}: cannot read spec ({e.strerror})") from None
    except safe_yaml.YAMLInputError as e:
        raise SpecError(f"{path}: {e}") from None


def load_spec(path: str | Path, preset: str = "cpu") -> Spec:
    """Load a YAML spec as untrusted input (harness.safe_yaml) and resolve it for ``preset``."""
    return parse_spec(read_spec_yaml(path), str(path), preset)


def count_cells(spec: Spec) -> int:
    """How many cells ``spec`` names (before duplicates are dropped), without building any."""
    total = sum(len(f.variants) for f in spec.frontier)
    for ax in spec.axes_blocks:
        pairs = (
            len(ax.lengths)
            if ax.lengths is not None
            else len(ax.total_len or []) * len(ax.prefix_ratio or [])
        )
        total += len(ax.models) * pairs * math.prod(len(getattr(ax, name)) for name in SWEPT)
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
    for ax in spec.axes_blocks:
        for cell in _expand_block(spec, ax):
            cells.setdefault(cell.cell_id, cell)
    for block in spec.alignment:
        for cell in _alignment_cells(spec, block):
            cells.setdefault(cell.cell_id, cell)
    return list(cells.values())


def _common(spec: Spec) -> dict[str, Any]:
    return {"spec": spec.name, "loss": spec.loss, "device": spec.device, "seed": spec.seed}


SWEPT = (
    "n", "suffix_spread", "layout", "microbatch", "memory_budget", "dtype", "compile", "ac", "offload",
    "parallel", "groups",
)  # fmt: skip


def _swept_values(ax: Axes, name: str) -> list:
    return ax.layouts() if name == "parallel" else getattr(ax, name)


def _expand_block(spec: Spec, ax: Axes) -> list[Cell]:
    fixed = {
        **_common(spec),
        "systems": tuple(ax.systems or spec.systems),
        "warmup": spec.warmup if ax.warmup is None else ax.warmup,
        "repeats": spec.repeats if ax.repeats is None else ax.repeats,
        "timeout_min": spec.executor.timeout_min,
        "split_threshold": ax.split_threshold,
    }
    cells = []
    for model, (p, s), *values in itertools.product(
        ax.models, ax.length_pairs(), *(_swept_values(ax, name) for name in SWEPT)
    ):
        swept = dict(zip(SWEPT, values, strict=True))
        if swept["microbatch"] != "auto":
            swept["memory_budget"] = None  # a budget only sizes "auto" microbatches (duplicates are dropped)
        cells.append(Cell(**fixed, model=model, prefix_len=p, suffix_len=s, **swept))
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


def _frontier_cells(spec: Spec, front: Frontier) -> list[Cell]:
    """One search cell per variant; its lengths are the search's first probe (harness.frontier)."""
    search = front.search()
    if search.mode == "ratio":
        prefix = max(1, min(search.min_len - 1, round(search.ratio * search.min_len)))
        first = (prefix, search.min_len - prefix)
    else:
        first = (search.prefix_len, search.min_len)
    model = front.model or spec.axes_blocks[0].models[0]
    return [
        Cell(
            **_common(spec),
            model=model,
            prefix_len=first[0],
            suffix_len=first[1],
            n=front.n,
            layout=front.layout,
            microbatch=front.microbatch,
            dtype=front.dtype,
            ac=front.ac,
            offload=variant.endswith("+offload"),
            systems=(variant.removesuffix("+offload"),),
            warmup=0,
            repeats=1,
            timeout_min=front.timeout_min or spec.executor.timeout_min,
            frontier=search,
        )
        for variant in front.variants
    ]
