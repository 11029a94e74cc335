"""A cell, one resolved point of a sweep, and the models it is built from: the model with its overrides,
the parallel layout, and the settings of a capacity-frontier search or an alignment run."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from harness.vision_workloads import VisionShape
from harness.workloads import TreeShape

SYSTEM_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
PEAK_OF = re.compile(r"^peak:([a-z][a-z0-9_]*)$")  # a memory budget: the measured peak of another system
MemoryBudget = int | str | None
OverrideValue = int | float | bool | str
NOT_IDENTITY = ("spec", "timeout_min")  # cell fields that do not change what is measured
MAX_INT = 2**31 - 1  # lengths, counts and repeats (records store int64)
Seed = Annotated[int, Field(ge=0, le=2**32 - 1, description="random seed, 0 .. 2**32-1")]
Count = Annotated[int, Field(ge=1, le=MAX_INT)]
TIMEOUT_MAX_MIN = 60 * 24 * 365


def check_systems(v: list[str]) -> list[str]:
    for s in v:
        if not SYSTEM_NAME.fullmatch(s):
            raise ValueError(f"system name {s!r} must match {SYSTEM_NAME.pattern}")
    if len(set(v)) != len(v):
        raise ValueError(f"systems {v} contain duplicates")
    return v


def _sizes_microbatches(system: str) -> bool:
    """Whether ``system`` splits its suffixes into microbatches (so ``auto`` sizes them by the budget)."""
    from harness.contenders import get_contender

    try:
        return getattr(get_contender(system), "library_system", None) is not None
    except ValueError:  # an unknown name is reported by the registry check
        return False


def check_budget(x) -> None:
    if x is None or (isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= 2**62):
        return
    if isinstance(x, str) and PEAK_OF.fullmatch(x):
        return
    raise ValueError(f"memory_budget {x!r} must be null, bytes >= 1, or 'peak:SYSTEM'")


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class LoraSpec(StrictModel):
    """LoRA adapters through PEFT on an ``hf:`` model (harness.run.lora): rank, alpha, and the projections
    they wrap (default: the family's attention and MLP projections); no dropout, so training stays exact."""

    r: int = Field(strict=True, ge=1, le=MAX_INT, description="adapter rank")
    alpha: float = Field(gt=0, le=2**31, description="LoRA alpha (scale alpha / r)")
    target_modules: tuple[str, ...] | None = Field(
        None,
        min_length=1,
        description="module names to wrap (default: attention q/k/v/o and MLP projections)",
    )

    @field_validator("target_modules")
    @classmethod
    def _names(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        for name in v or ():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,79}", name):
                raise ValueError(f"lora.target_modules entry {name!r} is not a module name (e.g. q_proj)")
        if v is not None and len(set(v)) != len(v):
            raise ValueError(f"lora.target_modules {list(v)} contain duplicates")
        return v


class ModelSpec(StrictModel):
    """A model plus config overrides: TorchTitan ``family:flavor`` (ModelArgs fields), or a Hugging Face
    ``hf:<built-in config name | local config.json path>`` (config fields; needs ``prefixflow[hf]``),
    optionally with LoRA adapters (``lora``, hf: only)."""

    name: str = Field(
        pattern=r"^([A-Za-z0-9_.-]+:[A-Za-z0-9_.-]+|hf:[A-Za-z0-9_./~-]{1,500})$",
        description="family:flavor, or hf:<config name or local config path>",
    )
    overrides: dict[str, OverrideValue] = Field(default_factory=dict)
    label: str | None = None
    lora: LoraSpec | None = Field(None, description="LoRA adapters through PEFT (hf: models only)")

    @model_validator(mode="after")
    def _lora_on_hf_only(self) -> ModelSpec:
        if self.lora is not None and not self.name.startswith("hf:"):
            raise ValueError(
                f"lora: LoRA goes through PEFT on Hugging Face models only; drop 'lora' or use an hf: model "
                f"(got {self.name!r})"
            )
        return self

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


class Parallel(StrictModel):
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


class FrontierSearch(StrictModel):
    """What one capacity-frontier search needs besides the cell (resolved; see harness.run.frontier)."""

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

    def split(self, length: int) -> tuple[int, int]:
        """(prefix_len, suffix_len) of the probe at searched ``length`` (never an empty side)."""
        if self.mode == "prefix":
            return int(self.prefix_len), length
        prefix = min(length - 1, max(1, round(self.ratio * length)))
        return prefix, length - prefix


def report_steps_for(steps: int) -> list[int]:
    """The paper's reported steps (1, 10, 20) that fall within ``steps``, plus the last step."""
    return sorted({s for s in (1, 10, 20) if s <= steps} | {steps})


class AlignmentSettings(StrictModel):
    """What an alignment cell (Table 3) needs besides the cell: AdamW steps and learning rate."""

    steps: int = Field(20, ge=1, description="AdamW steps; rows at steps 1, 10, 20 within them and the last")
    lr: float = Field(1e-5, gt=0)


class Cell(StrictModel):
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
    frontier: FrontierSearch | None = (
        None  # set: this cell is a capacity-frontier search (harness.run.frontier)
    )
    alignment: AlignmentSettings | None = None  # set: this cell is a Table 3 run (harness.run.parallel_step)
    # set: the step trains this seeded tree workload (harness.workloads; prefix_len/suffix_len/n are its
    # nominal trunk, longest path minus the trunk, and paths) instead of a synthetic flat group
    tree: TreeShape | None = None
    # set: the group's prompt holds this seeded image or video (harness.vision_workloads; prefix_len/suffix_len
    # are its prompt length and longest answer) on an hf: vision-language model; ``tower``: trained or frozen
    vision: VisionShape | None = None
    tower: Literal["trained", "frozen"] = "trained"

    @field_validator("systems")
    @classmethod
    def _systems(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(check_systems(list(v)))

    @model_validator(mode="after")
    def _budget_fits_microbatch(self) -> Cell:
        check_budget(self.memory_budget)
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
        if self.model.lora is not None and self.world_size > 1:
            raise ValueError(
                f"model.lora: LoRA cells run on one process; this cell's layout is {self.parallel.label}: "
                "use the single layout"
            )
        self._check_vision()
        if self.offload and self.parallel.pp > 1:
            raise ValueError(
                f"offload: PrefixFlow's offload does not run under pipeline parallelism (this cell's layout is "
                f"{self.parallel.label}); set offload false or pp 1"
            )
        if self.microbatch == "auto" and (self.world_size > 1 or self.groups_per_step > 1):
            raise ValueError(
                f"microbatch 'auto' runs on one process with one group per step; this cell's layout is "
                f"{self.parallel.label} with {self.groups_per_step} groups: use a fixed microbatch"
            )
        return self

    def _check_vision(self) -> None:
        from harness.vlm_models import VLM_MODELS

        name = self.model.name.removeprefix("hf:")
        if self.vision is None:
            if self.tower != "trained":
                raise ValueError("tower: 'frozen' needs a vision workload (axes.vision); drop it")
            return
        if not self.model.name.startswith("hf:") or name not in VLM_MODELS:
            raise ValueError(
                f"vision: workload {self.vision.kind!r} needs an hf: vision-language model ({sorted(VLM_MODELS)}), "
                f"not {self.model.name!r}"
            )
        if (
            self.tree is not None
            or self.world_size > 1
            or self.groups_per_step > 1
            or self.model.lora is not None
        ):
            raise ValueError(
                "vision: a vision cell is one group in one process: drop trees, parallel, groups, lora"
            )

    @property
    def cell_id(self) -> str:
        skip = set(NOT_IDENTITY) | ({"frontier"} if self.frontier is None else set())
        skip |= {"alignment"} if self.alignment is None else set()
        skip |= {"memory_budget"} if self.memory_budget is None else set()
        skip |= {"tree"} if self.tree is None else set()  # ids of earlier cells unchanged
        skip |= {"vision", "tower"} if self.vision is None else set()
        ident = self.model_dump(mode="json", exclude=skip)
        if self.model.lora is None:  # ids of cells without LoRA unchanged
            ident["model"].pop("lora")
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
