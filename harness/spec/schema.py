"""The blocks of a sweep spec file: axes, capacity-frontier searches, alignment runs, executor settings,
and the ``Spec`` that holds them (harness.spec.load loads and expands it)."""

from __future__ import annotations

import itertools
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from harness.spec.cell import (
    MAX_INT,
    PARALLEL_DIMS,
    SYSTEM_NAME,
    TIMEOUT_MAX_MIN,
    AlignmentSettings,
    Count,
    FrontierSearch,
    MemoryBudget,
    ModelSpec,
    Parallel,
    Seed,
    StrictModel,
    check_budget,
    check_systems,
)
from harness.vision_workloads import VisionShape
from harness.workloads import TreeShape


class LengthPair(StrictModel):
    prefix: int = Field(ge=1, le=MAX_INT)
    suffix: int = Field(ge=1, le=MAX_INT)


class Axes(StrictModel):
    """The swept axes; their cartesian product is the set of cells."""

    models: list[ModelSpec] = Field(min_length=1)
    lengths: list[LengthPair] | None = Field(None, min_length=1, description="explicit prefix/suffix")
    prefix_ratio: list[float] | None = Field(None, min_length=1)
    total_len: list[Count] | None = Field(None, min_length=1)
    n: list[Count] | None = Field(None, min_length=1, description="responses per group (not with 'trees')")
    trees: list[TreeShape] | None = Field(
        None, min_length=1, description="tree workloads (harness.workloads), instead of lengths and n"
    )
    vision: list[VisionShape] | None = Field(
        None, min_length=1, description="image/video prompts (harness.vision_workloads), instead of lengths"
    )
    tower: list[Literal["trained", "frozen"]] = Field(
        default_factory=lambda: ["trained"], min_length=1, description="vision cells: the tower trains or not"
    )
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
            check_budget(x)
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
        if self.trees is not None:
            given = [k for k in ("lengths", "prefix_ratio", "total_len", "n") if getattr(self, k) is not None]
            if given:
                raise ValueError(f"'trees' sets the lengths and paths of its cells; drop {given}")
            return self
        if self.vision is not None:
            given = [k for k in ("lengths", "prefix_ratio", "total_len") if getattr(self, k) is not None]
            if given:
                raise ValueError(f"'vision' sets the prompt and answer lengths of its cells; drop {given}")
        elif "tower" in self.model_fields_set:
            raise ValueError("'tower' applies to vision cells only; give 'vision' shapes or drop 'tower'")
        if self.n is None:
            raise ValueError("give 'n' (responses per group), or 'trees' (tree workloads)")
        if self.vision is not None:
            return self
        ratio_form = self.prefix_ratio is not None or self.total_len is not None
        if self.lengths is not None and ratio_form:
            raise ValueError("give either 'lengths' or 'prefix_ratio' x 'total_len', not both")
        if self.lengths is None and (self.prefix_ratio is None or self.total_len is None):
            raise ValueError(
                "give 'lengths' (list of {prefix, suffix}) or both 'prefix_ratio' and 'total_len'"
            )
        return self

    def length_pairs(self) -> list[tuple[int, int]]:
        if self.trees is not None:
            return [shape.nominal()[:2] for shape in self.trees]
        if self.vision is not None:
            return [shape.nominal() for shape in self.vision]
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


class ExecutorSettings(StrictModel):
    """Where and how cells run; Slurm keys are ignored by the local and debug executors. Numbers are taken as
    they are written (``nodes: '2'`` is refused, not coerced)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

    kind: Literal["measure", "estimate"] = Field(
        "measure",
        description="measure: run the cells; estimate: their memory and FLOPs on fake tensors "
        "(harness.estimate, as `pf-bench sweep --estimate`)",
    )
    max_jobs: int = Field(
        2, ge=1, le=10_000, description="concurrent cells (local) / array parallelism (slurm)"
    )
    timeout_min: float = Field(10.0, gt=0, le=TIMEOUT_MAX_MIN, description="per-cell limit in minutes")
    partition: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    nodes: int = Field(
        1,
        ge=1,
        le=MAX_INT,
        description="Slurm nodes per multi-rank cell, its ranks spread evenly (--nodes, --ntasks-per-node); "
        "single-rank cells take one node",
    )
    gpus_per_node: int = Field(0, ge=0, le=MAX_INT)
    cpus_per_task: int = Field(1, ge=1, le=MAX_INT)
    mem_gb: float = Field(4.0, gt=0, le=2**40)
    overcommit: bool = Field(
        False, description="Slurm --overcommit for multi-rank cells: more ranks than CPUs (small CPU nodes)"
    )


class CellLimits(StrictModel):
    """Bounds on one cell's work, checked at load: its paths (responses) and its path tokens (paths x the
    longest path); raise them here to run larger cells."""

    max_paths: int = Field(100_000, ge=1, le=MAX_INT, description="paths (responses) per cell")
    max_tokens: int = Field(10_000_000, ge=1, le=2**62, description="path tokens per cell")

    def check(self, where: str, paths: int, longest: int) -> None:
        """ValueError naming ``where`` when ``paths`` paths of up to ``longest`` tokens exceed the limits."""
        if paths > self.max_paths:
            raise ValueError(
                f"{where}: {paths:,} paths per cell, more than limits.max_paths={self.max_paths:,}; shrink the "
                f"shape, or raise limits.max_paths"
            )
        if paths * longest > self.max_tokens:
            raise ValueError(
                f"{where}: {paths:,} paths x {longest:,} tokens = {paths * longest:,} path tokens per cell, more "
                f"than limits.max_tokens={self.max_tokens:,}; shrink the cell, or raise limits.max_tokens"
            )


def _pairs(block: Axes) -> list[tuple[int, int]]:
    try:
        return block.length_pairs()
    except ValueError:  # reported by the loader with the block's name
        return []


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
    parallel: Parallel = Field(default_factory=Parallel, description="the layout every probe runs in")
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


class Spec(StrictModel):
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
    limits: CellLimits = Field(
        default_factory=CellLimits, description="bounds on each cell's paths and tokens"
    )
    presets: dict[Literal["cpu", "paper", "smoke"], dict[str, Any]] = Field(default_factory=dict)

    @field_validator("systems")
    @classmethod
    def _systems(cls, v: list[str]) -> list[str]:
        return check_systems(v)

    @model_validator(mode="after")
    def _block_systems(self) -> Spec:
        for block in self.axes_blocks:
            check_systems(block.systems or [])
        return self

    @model_validator(mode="after")
    def _ranks_spread_over_nodes(self) -> Spec:
        nodes = self.executor.nodes
        layouts = [p for b in self.axes_blocks for p in b.layouts()] + [
            p for a in self.alignment for p in a.parallel
        ]
        for p in layouts:
            if p.world_size > 1 and p.world_size % nodes:
                raise ValueError(
                    f"executor.nodes={nodes} does not divide parallel layout {p.label} ({p.world_size} ranks): "
                    f"give layouts whose ranks are a multiple of executor.nodes, or executor.nodes: 1"
                )
        return self

    @model_validator(mode="after")
    def _cells_within_limits(self) -> Spec:
        for i, block in enumerate(self.axes_blocks):
            where = "axes" if i == 0 else f"extra_axes.{i - 1}"
            if block.trees is not None:
                for j, shape in enumerate(block.trees):
                    trunk, rest, paths = shape.nominal()
                    self.limits.check(f"{where}.trees.{j}", paths, trunk + rest)
            else:
                longest = max((p + s for p, s in _pairs(block)), default=0)
                for n in block.n or []:
                    self.limits.check(f"{where}.n", n, longest)
        for i, block in enumerate(self.alignment):
            self.limits.check(f"alignment.{i}", block.n, block.prefix_len + block.suffix_len)
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
