"""Sweep specs (pydantic v2, loaded with yaml.safe_load) and their expansion into cells."""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

PRESETS = ("cpu", "paper")
SYSTEM_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
OverrideValue = int | float | bool | str
NOT_IDENTITY = ("spec", "timeout_min")  # cell fields that do not change what is measured


class SpecError(ValueError):
    """A spec could not be loaded; the message names the file, the field and what is allowed."""


def safe_name(text: str, max_len: int = 80) -> str:
    """Reduce ``text`` to [A-Za-z0-9._-]; never empty, never '.'/'..', never starting with '.'/'-'."""
    out = re.sub(r"[^A-Za-z0-9._-]+", "_", str(text)).strip("._-")[:max_len]
    return out or "unnamed"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    """A TorchTitan model: ``family:flavor`` plus ModelArgs overrides."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+:[A-Za-z0-9_.-]+$", description="family:flavor")
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


class Parallel(_Strict):
    """Parallel layout of one cell. Only all-1 runs today; the schema carries the rest."""

    tp: int = Field(1, ge=1)
    cp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    dp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp * self.ep


class LengthPair(_Strict):
    prefix: int = Field(ge=1)
    suffix: int = Field(ge=1)


class Axes(_Strict):
    """The swept axes; their cartesian product is the set of cells."""

    models: list[ModelSpec] = Field(min_length=1)
    lengths: list[LengthPair] | None = Field(None, min_length=1, description="explicit prefix/suffix")
    prefix_ratio: list[float] | None = Field(None, min_length=1)
    total_len: list[int] | None = Field(None, min_length=1)
    n: list[int] = Field(min_length=1)
    suffix_spread: list[float] = Field(default_factory=lambda: [0.0], min_length=1)
    layout: list[Literal["padded", "packed"]] = Field(default_factory=lambda: ["padded"], min_length=1)
    microbatch: list[int | None] = Field(default_factory=lambda: [None], min_length=1)
    dtype: list[Literal["fp32", "bf16", "fp64"]] = Field(default_factory=lambda: ["fp32"], min_length=1)
    compile: list[bool] = Field(default_factory=lambda: [False], min_length=1)
    ac: list[Literal["selective", "full", "none"]] = Field(default_factory=lambda: ["none"], min_length=1)
    offload: list[bool] = Field(default_factory=lambda: [False], min_length=1)
    parallel: list[Parallel] = Field(default_factory=lambda: [Parallel()], min_length=1)

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
    def _microbatch(cls, v: list[int | None]) -> list[int | None]:
        for x in v:
            if x is not None and x < 1:
                raise ValueError(f"microbatch {x} must be >= 1 or null (whole group)")
        return v

    @field_validator("suffix_spread")
    @classmethod
    def _spread(cls, v: list[float]) -> list[float]:
        for x in v:
            if not 0.0 <= x < 1.0:
                raise ValueError(f"suffix_spread {x} must be in [0, 1)")
        return v

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

    max_jobs: int = Field(2, ge=1, description="concurrent cells (local) / array parallelism (slurm)")
    timeout_min: float = Field(10.0, gt=0, description="per-cell wall-clock limit in minutes")
    partition: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$")
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0)
    cpus_per_task: int = Field(1, ge=1)
    mem_gb: float = Field(4.0, gt=0)


class Spec(_Strict):
    """A sweep: axes x systems, with measurement and executor settings."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,79}$")
    description: str = ""
    systems: list[str] = Field(default_factory=lambda: ["baseline", "prefixflow"], min_length=1)
    loss: Literal["pg", "grpo"] = "pg"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    warmup: int = Field(1, ge=0)
    repeats: int = Field(3, ge=1)
    axes: Axes
    executor: ExecutorSettings = Field(default_factory=ExecutorSettings)
    presets: dict[Literal["cpu", "paper"], dict[str, Any]] = Field(default_factory=dict)

    @field_validator("systems")
    @classmethod
    def _systems(cls, v: list[str]) -> list[str]:
        for s in v:
            if not SYSTEM_NAME.fullmatch(s):
                raise ValueError(f"system name {s!r} must match {SYSTEM_NAME.pattern}")
        if len(set(v)) != len(v):
            raise ValueError(f"systems {v} contain duplicates")
        return v

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
    prefix_len: int = Field(ge=1)
    suffix_len: int = Field(ge=1)
    n: int = Field(ge=1)
    suffix_spread: float = 0.0
    layout: Literal["padded", "packed"] = "padded"
    microbatch: int | None = None
    dtype: Literal["fp32", "bf16", "fp64"] = "fp32"
    compile: bool = False
    ac: Literal["selective", "full", "none"] = "none"
    offload: bool = False
    parallel: Parallel = Field(default_factory=Parallel)
    systems: tuple[str, ...] = ("baseline", "prefixflow")
    loss: Literal["pg", "grpo"] = "pg"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    warmup: int = Field(1, ge=0)
    repeats: int = Field(3, ge=1)
    timeout_min: float = Field(10.0, gt=0)

    @property
    def cell_id(self) -> str:
        ident = self.model_dump(mode="json", exclude=set(NOT_IDENTITY))
        blob = json.dumps(ident, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

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


def _describe(err: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid spec"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (remove it or check its spelling)"
        elif e["type"] == "literal_error" and e.get("ctx", {}).get("expected"):
            msg = f"not allowed; allowed: {e['ctx']['expected']}"
        lines.append(f"  {loc}: {msg} (got {e.get('input')!r})")
    return "\n".join(lines)


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
        raise SpecError(_describe(e, source)) from None
    resolved = base
    for name, body in base.presets.items():
        merged = _deep_merge({k: v for k, v in raw.items() if k != "presets"}, body)
        try:
            spec = Spec.model_validate(merged)
        except ValidationError as e:
            raise SpecError(_describe(e, f"{source} (with preset '{name}' applied)")) from None
        if name == preset:
            resolved = spec
    try:
        resolved.axes.length_pairs()
    except ValueError as e:
        raise SpecError(f"{source}: axes: {e}") from None
    return resolved


def load_spec(path: str | Path, preset: str = "cpu") -> Spec:
    """Load a YAML spec safely (yaml.safe_load) and resolve it for ``preset``."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError(f"{path}: cannot read spec ({e.strerror})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: not valid YAML: {e}") from None
    return parse_spec(raw, str(path), preset)


def expand(spec: Spec) -> list[Cell]:
    """Cartesian product of the axes; duplicates (same id) are dropped, order is stable."""
    ax = spec.axes
    cells: dict[str, Cell] = {}
    for model, (p, s), n, spread, layout, mb, dtype, comp, ac, off, par in itertools.product(
        ax.models,
        ax.length_pairs(),
        ax.n,
        ax.suffix_spread,
        ax.layout,
        ax.microbatch,
        ax.dtype,
        ax.compile,
        ax.ac,
        ax.offload,
        ax.parallel,
    ):
        cell = Cell(
            spec=spec.name,
            model=model,
            prefix_len=p,
            suffix_len=s,
            n=n,
            suffix_spread=spread,
            layout=layout,
            microbatch=mb,
            dtype=dtype,
            compile=comp,
            ac=ac,
            offload=off,
            parallel=par,
            systems=tuple(spec.systems),
            loss=spec.loss,
            device=spec.device,
            seed=spec.seed,
            warmup=spec.warmup,
            repeats=spec.repeats,
            timeout_min=spec.executor.timeout_min,
        )
        cells.setdefault(cell.cell_id, cell)
    return list(cells.values())
