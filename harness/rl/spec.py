"""The Claim-2 spec (``experiments/claim2.yaml``): one closed-loop GRPO comparison and its trace replays.

Loaded with ``harness.spec.safe_yaml`` and validated by pydantic, like the sweep specs; presets (``smoke``, ``cpu``,
``paper``) are deep-merged over the top level. Unknown keys and bad values name the file and the field.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from harness.spec.cell import ModelSpec, Parallel
from harness.spec.checks import describe_validation_error
from harness.spec.load import SpecError, _deep_merge, read_spec_yaml
from harness.spec.schema import ExecutorSettings

__all__ = ["RLSpec", "RL_PRESETS", "load_rl_spec", "parse_rl_spec"]

RL_PRESETS = ("smoke", "ranks", "cpu", "cpu-tp2", "paper", "multiturn", "multiturn-smoke")
TRAINERS = ("baseline", "prefixflow")
#: every trainer: ``baseline`` (each path a full sequence), ``prefixflow`` (flat: the group's longest common
#: prefix shared), ``prefixflow_tree`` (the group's prefix tree: every shared turn once; harness.rl.trainers)
ALL_TRAINERS = ("baseline", "prefixflow", "prefixflow_tree")
Trainer = Literal["baseline", "prefixflow", "prefixflow_tree"]
MULTITURN_FIELDS = ("system_len", "note_len", "fields", "calls", "reply_text")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TaskSpec(_Strict):
    """``kind: retrieval`` (``harness.rl.task.RetrievalTask``: the prefix ratio sets the passage count) or
    ``kind: multiturn`` (``harness.rl.multiturn.MultiTurnTask``: a tool call, the tool's reply, an answer;
    ``prefix_ratio`` then unused, the ``MULTITURN_FIELDS`` shape it)."""

    kind: Literal["retrieval", "multiturn"] = "retrieval"
    prefix_ratio: float = Field(0.95, ge=0.5, lt=1.0, description="retrieval only")
    value_len: int = Field(4, ge=1, le=4096)
    n_keys: int | None = Field(None, ge=2, le=100_000, description="key symbols (default: the passage count)")
    choices: int = Field(4, ge=2, le=1024, description="tokens each answer position can take (its type)")
    system_len: int | None = Field(None, ge=1, le=65_536, description="multiturn: system-prompt tokens")
    note_len: int | None = Field(None, ge=0, le=4096, description="multiturn: free note tokens before a call")
    fields: int | None = Field(
        None, ge=1, le=1024, description="multiturn: fields per key in the tool's table"
    )
    calls: int | None = Field(
        None, ge=1, le=1024, description="multiturn: turn-1 samples per prompt (loop.n / calls answers each)"
    )
    reply_text: int | None = Field(
        None, ge=0, le=65_536, description="multiturn: text tokens in a tool reply"
    )

    @model_validator(mode="after")
    def _kind_fields(self) -> TaskSpec:
        if self.kind == "retrieval":
            given = [f for f in MULTITURN_FIELDS if getattr(self, f) is not None]
            if given:
                raise ValueError(f"task.{given[0]} is a multiturn field; set task.kind: multiturn or drop it")
        return self


class WarmStartSpec(_Strict):
    """Supervised warm start shared by every run (answer cross-entropy, AdamW) on short prompts."""

    steps: int = Field(300, ge=0, le=100_000)
    batch: int = Field(32, ge=1, le=4096)
    lr: float = Field(3e-3, gt=0, le=1.0)
    passages: int = Field(3, ge=1, description="passages per warm-start prompt (a short context)")
    eval_prompts: int = Field(32, ge=1, le=100_000, description="prompts that measure the warm-start reward")
    label_smoothing: float = Field(
        0.0, ge=0.0, lt=1.0, description="cross-entropy label smoothing (a less confident warm-start policy)"
    )


class LoopSpec(_Strict):
    """The GRPO recipe, identical for every trainer."""

    steps: int = Field(100, ge=1, le=100_000)
    prompts_per_step: int = Field(2, ge=1, le=1024)
    n: int = Field(8, ge=2, le=1024, description="responses per prompt")
    temperature: float = Field(1.0, ge=0.0, le=10.0, allow_inf_nan=False)
    max_new_tokens: int = Field(8, ge=1, le=65_536)
    lr: float = Field(1e-4, gt=0, le=1.0)
    lr_warmup_steps: int = Field(0, ge=0, description="at most loop.steps (a longer warmup never reaches lr)")
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(
        1e-8, gt=0, le=1.0, allow_inf_nan=False, description="AdamW's; above 1 it trains nothing"
    )
    weight_decay: float = Field(
        0.0, ge=0, le=10.0, allow_inf_nan=False, description="AdamW's decoupled decay; lr * weight_decay < 1"
    )
    fused_adamw: bool = Field(
        True, description="torch.optim.AdamW(fused=True): one kernel for all parameters (CPU and CUDA)"
    )
    max_grad_norm: float | None = Field(1.0, gt=0, allow_inf_nan=False, description="null: no clipping")
    clip_eps_low: float = Field(0.2, ge=0, le=1.0, allow_inf_nan=False)
    clip_eps_high: float = Field(0.2, ge=0, le=100.0, allow_inf_nan=False)
    kl_coef: float = Field(0.0, ge=0, le=1000.0, allow_inf_nan=False)
    aggregation: Literal["seq-mean-token-mean", "token-mean"] = "seq-mean-token-mean"
    layout: Literal["padded", "packed"] = "padded"
    microbatch: int | None = Field(None, ge=1)
    attention: Literal["auto", "concat", "split"] = "auto"
    dtype: Literal["fp32", "bf16"] = "fp32"

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"betas {v} must lie in [0, 1)")
        return v

    @model_validator(mode="after")
    def _schedule(self) -> LoopSpec:
        if self.lr_warmup_steps > self.steps:
            raise ValueError(
                f"lr_warmup_steps ({self.lr_warmup_steps}) exceeds steps ({self.steps}): the learning rate would "
                f"never reach lr; use at most {self.steps}"
            )
        if self.lr * self.weight_decay >= 1.0:
            raise ValueError(
                f"lr * weight_decay = {self.lr * self.weight_decay:g} >= 1: AdamW multiplies every weight by "
                "1 - lr * weight_decay each step; lower weight_decay (e.g. 0.01)"
            )
        return self

    def loss_config(self) -> dict[str, Any]:
        return {
            "clip_eps_low": self.clip_eps_low,
            "clip_eps_high": self.clip_eps_high,
            "kl_coef": self.kl_coef,
            "aggregation": self.aggregation,
        }

    def lr_at(self, step: int, peak: float | None = None) -> float:
        """The learning rate of ``step`` (1-based): linear warmup to ``peak`` (default ``lr``), then constant."""
        peak = self.lr if peak is None else peak
        if self.lr_warmup_steps and step <= self.lr_warmup_steps:
            return peak * step / self.lr_warmup_steps
        return peak


class TraceRun(_Strict):
    """One exported trace: the baseline's first ``trace.steps`` steps in ``dtype``, at the loop's learning
    rate (``lr`` null; the main run exports it when the dtype is the loop's) or at ``lr`` (a short run)."""

    dtype: Literal["fp32", "bf16"]
    lr: float | None = Field(None, gt=0, le=1.0)


class TraceSpec(_Strict):
    """Frozen-trace replay (Figure 8b): export traces of the baseline, replay each with ``systems``."""

    steps: int = Field(20, ge=1, le=10_000)
    runs: list[TraceRun] = Field(default_factory=lambda: [TraceRun(dtype="fp32")], min_length=1)
    systems: list[Trainer] = Field(default_factory=lambda: ["prefixflow"], min_length=1)

    @field_validator("runs")
    @classmethod
    def _distinct(cls, v: list[TraceRun]) -> list[TraceRun]:
        if len({(r.dtype, r.lr) for r in v}) != len(v):
            raise ValueError("trace runs must differ in dtype or lr")
        return v


class Claim3Reference(_Strict):
    """A Claim-3 style measurement of ``train_group`` alone at the loop's P, S and N (the actor-update target)."""

    enabled: bool = True
    warmup: int = Field(1, ge=0)
    repeats: int = Field(3, ge=1, le=100)


class RLSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,79}$")
    description: str = ""
    model: ModelSpec
    task: TaskSpec = Field(default_factory=TaskSpec)
    warm_start: WarmStartSpec = Field(default_factory=WarmStartSpec)
    loop: LoopSpec = Field(default_factory=LoopSpec)
    trainers: list[Trainer] = Field(default_factory=lambda: list(TRAINERS))
    seed: int = Field(0, ge=0, description="sampling seed of the compared runs (also the model init)")
    reference_seed: int | None = Field(
        1,
        ge=0,
        description="every trainer again at this sampling seed: the seed-change reference (same trainer) and "
        "the cross-system pairs whose rollouts are forked (other trainer), as the paper's were",
    )
    data_seed: int = Field(0, ge=0, description="prompt stream (the same for every run)")
    checkpoint_every: int = Field(10, ge=1)
    schedule: Literal["lockstep", "sequential"] = Field(
        "lockstep",
        description="lockstep: step t of every run before step t+1 of any (every trainer timed under the same "
        "machine load; every run's models held at once); sequential: one run after another, each run's models "
        "freed before the next is built (a large model), the Claim-3 reference measured after the runs",
    )
    trace: TraceSpec | None = Field(default_factory=TraceSpec)
    claim3_reference: Claim3Reference = Field(default_factory=Claim3Reference)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    parallel: Parallel = Field(default_factory=Parallel)
    executor: ExecutorSettings = Field(default_factory=ExecutorSettings)
    presets: dict[
        Literal["smoke", "ranks", "cpu", "cpu-tp2", "paper", "multiturn", "multiturn-smoke"], dict[str, Any]
    ] = Field(default_factory=dict)

    @field_validator("model")
    @classmethod
    def _titan_model(cls, v: ModelSpec) -> ModelSpec:
        if v.name.startswith("hf:"):
            raise ValueError(
                f"{v.name}: the RL loop builds TorchTitan models only (family:flavor, e.g. llama3:debugmodel); "
                "hf: models run in pf-bench run/sweep and through PrefixFlowGRPOTrainer"
            )
        return v

    @field_validator("trainers")
    @classmethod
    def _trainers(cls, v: list[str]) -> list[str]:
        if sorted(set(v)) != sorted(v) or "baseline" not in v:
            raise ValueError(f"trainers {v} must be distinct and include 'baseline' (the reference)")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> RLSpec:
        if self.reference_seed is not None and self.reference_seed == self.seed:
            raise ValueError(f"reference_seed must differ from seed ({self.seed}): it is a seed change")
        if self.task.kind == "multiturn":
            calls = self.task.calls or 1
            if self.loop.n % calls:
                raise ValueError(
                    f"loop.n ({self.loop.n}) must be a multiple of task.calls ({calls}): n / calls answers per call"
                )
            if self.claim3_reference.enabled:
                raise ValueError(
                    "claim3_reference.enabled must be false for task.kind multiturn (the reference times flat "
                    "groups of one prompt and N answers, not trees)"
                )
            if self.parallel.world_size > 1:
                raise ValueError(
                    f"task.kind multiturn runs on one process (parallel {self.parallel.label}); drop parallel"
                )
        elif "prefixflow_tree" in self.trainers or (
            self.trace is not None and "prefixflow_tree" in self.trace.systems
        ):
            raise ValueError(
                "trainer prefixflow_tree needs task.kind: multiturn (a retrieval group is one level: its tree is "
                "the flat group)"
            )
        if self.loop.steps < self.checkpoint_every:
            raise ValueError(
                f"checkpoint_every ({self.checkpoint_every}) exceeds loop.steps ({self.loop.steps})"
            )
        if (
            self.trace is not None
            and self.trace.steps > self.loop.steps
            and any(self.is_main_trace(r) for r in self.trace.runs)
        ):
            raise ValueError(f"trace.steps ({self.trace.steps}) exceeds loop.steps ({self.loop.steps})")
        return self

    def is_main_trace(self, run: TraceRun) -> bool:
        """Whether the main baseline run exports this trace (same dtype and learning rate)."""
        return run.dtype == self.loop.dtype and run.lr in (None, self.loop.lr)

    def warm_start_identity(self) -> str:
        """A digest of what the shared warm start depends on (model, task, warm start, seeds, and how its
        reward is measured)."""
        keep = {"model", "task", "warm_start", "seed", "data_seed", "device"}
        ident = self.model_dump(mode="json", include=keep)
        loop = self.loop
        ident["eval"] = [loop.dtype, loop.n, loop.temperature, loop.max_new_tokens, loop.attention]
        blob = json.dumps(ident, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def identity(self, **extra: Any) -> str:
        """A 12-hex digest of everything that changes a run's numbers (names, executors and the schedule
        excluded)."""
        ident = self.model_dump(
            mode="json", exclude={"name", "description", "executor", "presets", "schedule"}
        )
        blob = json.dumps({**ident, **extra}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def parse_rl_spec(raw: Any, source: str = "<spec>", preset: str | None = None) -> RLSpec:
    """Validate a Claim-2 spec and every preset; return it resolved for ``preset`` (None: the top level)."""
    if preset is not None and preset not in RL_PRESETS:
        raise SpecError(f"{source}: unknown preset {preset!r}; allowed: {', '.join(RL_PRESETS)}")
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: top level must be a mapping with 'name' and 'model'")
    try:
        base = RLSpec.model_validate(raw)
    except ValidationError as e:
        raise SpecError(describe_validation_error(e, source)) from None
    resolved = base
    for name, body in base.presets.items():
        merged = _deep_merge({k: v for k, v in raw.items() if k != "presets"}, body)
        try:
            spec = RLSpec.model_validate(merged)
        except ValidationError as e:
            raise SpecError(
                describe_validation_error(e, f"{source} (with preset '{name}' applied)")
            ) from None
        if name == preset:
            resolved = spec
    if preset is not None and preset not in base.presets:
        raise SpecError(
            f"{source}: has no preset {preset!r}; it defines: {', '.join(base.presets) or 'none'}"
        )
    return resolved


def load_rl_spec(path: str | Path, preset: str | None = None) -> RLSpec:
    """Load a Claim-2 YAML spec as untrusted input (harness.spec.safe_yaml) and resolve it for ``preset``."""
    return parse_rl_spec(read_spec_yaml(path), str(path), preset)
