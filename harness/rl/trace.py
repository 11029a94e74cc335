"""Frozen-trace export and replay (Claim 2.2, Figure 8b).

A trace is a folder holding the trainer inputs of K consecutive steps of one run and the weights after each:

    manifest.json           format, model, dtype, loss and optimizer settings, and per step: its learning rate,
                            the file of its inputs and the file of the weights after it, each with SHA-256
    initial.safetensors     actor weights (``w.<name>``) and AdamW state (``opt.<key>.<name>``) before step 1
    step_NNNNN.safetensors  per group g: ``g<g>.prompt``, ``.responses`` (concatenated), ``.response_lens``,
                            ``.advantages``, ``.old_logprobs``, ``.ref_logprobs`` (when the KL term is on),
                            ``.loss_masks`` (a multi-turn group: bool, concatenated, False on tool replies)
    after_NNNNN.safetensors the source run's weights after the step

Replaying feeds the same groups, advantages, old/reference log-probs and learning rates to
``actor_update`` with another (or the same) trainer (``harness.rl.trainers``) and compares the weights after
every step. A multi-turn trace is a tree trace: its groups carry loss masks, and its tree is not stored but
rebuilt from the paths by ``prefixflow.build_tree`` (so a trace cannot hold a tree that disagrees with its
tokens); its masks are validated like every other tensor (dtype, length, one trained token per path).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

import prefixflow as pf
from harness.rl.io import (
    TraceError,
    load_optimizer,
    load_tensors,
    load_weights,
    optimizer_tensors,
    read_json,
    save_tensors,
    sha256_of,
    state_tensors,
    write_json,
    writes_here,
)
from harness.rl.trainers import TRAINERS, trainer_inputs
from prefixflow.rl import actor_update, named_parameters

__all__ = ["TraceWriter", "Trace", "load_trace", "replay_trace", "TAU_ABS", "TAU_REL", "FORMAT", "nan_max"]

FORMAT = "prefixflow-grpo-trace"
VERSION = 1
TAU_ABS, TAU_REL = 1e-3, 1e-2
_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,120}\.safetensors$")
MAX_STEPS, MAX_GROUPS = 100_000, 4096


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileRef(_Strict):
    file: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @field_validator("file")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        if not _FILE.fullmatch(v):
            raise ValueError(f"{v!r} is not a plain .safetensors file name inside the trace folder")
        return v


class StepRef(_Strict):
    step: int = Field(ge=1)
    lr: float = Field(gt=0, le=1.0)
    n_groups: int = Field(ge=1, le=MAX_GROUPS)
    loss: float | None = None
    inputs: FileRef
    after: FileRef


class OptimizerRef(_Strict):
    type: Literal["AdamW"] = "AdamW"
    betas: tuple[float, float]
    eps: float = Field(gt=0)
    weight_decay: float = Field(ge=0)
    fused: bool = False  # torch.optim.AdamW(fused=...): the kernel changes the last bits of every step
    max_grad_norm: float | None = Field(None, gt=0)


class Manifest(_Strict):
    format: Literal["prefixflow-grpo-trace"]
    version: Literal[1]
    model: str = Field(pattern=r"^[A-Za-z0-9_.-]+:[A-Za-z0-9_.-]+$")
    overrides: dict[str, int | float | bool | str]
    dtype: Literal["fp32", "bf16"]
    system: str
    seed: int
    run: str
    git_rev: str = "unknown"
    loss_config: dict[str, float | str]
    layout: Literal["padded", "packed"]
    microbatch: int | None = Field(None, ge=1)
    attention: Literal["auto", "concat", "split"] = "auto"
    optimizer: OptimizerRef
    initial: FileRef
    steps: list[StepRef] = Field(min_length=1, max_length=MAX_STEPS)


class TraceWriter:
    """Writes a trace while its source run steps (resumable: files are rewritten by a rerun)."""

    def __init__(self, folder: Path, header: dict[str, Any], root: Path | None = None) -> None:
        self.folder, self.header, self.root = Path(folder), header, root

    def write_initial(self, model, optimizer) -> None:
        tensors = {**state_tensors(model, "w."), **optimizer_tensors(model, optimizer)}
        save_tensors(self.folder / "initial.safetensors", tensors, root=self.root)

    def write_step(self, step: int, trace: dict[str, Any], loss: float) -> None:
        tensors: dict[str, torch.Tensor] = {}
        for g, group in enumerate(trace["groups"]):
            tensors[f"g{g}.prompt"] = group.prompt
            tensors[f"g{g}.responses"] = torch.cat(group.responses)
            tensors[f"g{g}.response_lens"] = torch.tensor(group.response_lens, dtype=torch.int64)
            tensors[f"g{g}.advantages"] = group.advantages
            tensors[f"g{g}.old_logprobs"] = torch.cat(group.old_logprobs)
            if group.ref_logprobs is not None:
                tensors[f"g{g}.ref_logprobs"] = torch.cat(group.ref_logprobs)
            if group.loss_masks is not None:
                tensors[f"g{g}.loss_masks"] = torch.cat(group.loss_masks)
        meta = {"lr": repr(trace["lr"]), "n_groups": str(len(trace["groups"])), "loss": repr(loss)}
        save_tensors(self.folder / f"step_{step:05d}.safetensors", tensors, meta, self.root)
        weights = {f"w.{k}": v for k, v in trace["weights"].items()}
        save_tensors(self.folder / f"after_{step:05d}.safetensors", weights, root=self.root)

    def finish(self, steps: int) -> Path:
        """Hash every file and write ``manifest.json`` last (a trace without it is incomplete). On a rank
        other than 0 (which wrote nothing), nothing."""
        if not writes_here():
            return self.folder / "manifest.json"
        refs = []
        for step in range(1, steps + 1):
            inputs = self.folder / f"step_{step:05d}.safetensors"
            _, meta = load_tensors(inputs)
            refs.append(
                {
                    "step": step,
                    "lr": float(meta["lr"]),
                    "n_groups": int(meta["n_groups"]),
                    "loss": float(meta["loss"]),
                    "inputs": {"file": inputs.name, "sha256": sha256_of(inputs)},
                    "after": {
                        "file": f"after_{step:05d}.safetensors",
                        "sha256": sha256_of(self.folder / f"after_{step:05d}.safetensors"),
                    },
                }
            )
        initial = self.folder / "initial.safetensors"
        manifest = {
            **self.header,
            "format": FORMAT,
            "version": VERSION,
            "initial": {"file": initial.name, "sha256": sha256_of(initial)},
            "steps": refs,
        }
        Manifest.model_validate(manifest)
        return write_json(self.folder / "manifest.json", manifest, self.root)


class Trace:
    """A verified trace folder: the manifest is validated on load, each file is hash-checked as it is read."""

    def __init__(self, folder: Path, manifest: Manifest) -> None:
        self.folder, self.manifest = folder, manifest

    @property
    def name(self) -> str:
        return self.folder.name

    def tensors(self, ref: FileRef) -> dict[str, torch.Tensor]:
        return load_tensors(self.folder / ref.file, ref.sha256)[0]

    def groups(self, step: StepRef) -> list[pf.RolloutGroup]:
        path = self.folder / step.inputs.file
        t = self.tensors(step.inputs)
        expected = {f"g{g}.{k}" for g in range(step.n_groups) for k in (*GROUP_TENSORS, *OPTIONAL_TENSORS)}
        extra = set(t) - expected
        if extra:
            raise TraceError(f"{path}: unexpected tensors {sorted(extra)[:3]}")
        return [_group(t, g, path) for g in range(step.n_groups)]


GROUP_TENSORS = ("prompt", "responses", "response_lens", "advantages", "old_logprobs", "ref_logprobs")
OPTIONAL_TENSORS = ("loss_masks",)


def _split(t: dict[str, torch.Tensor], key: str, sizes: list[int], path: Path) -> list[torch.Tensor] | None:
    value = t.get(key)
    if value is None:
        return None
    if value.dim() != 1 or value.numel() != sum(sizes):
        raise TraceError(f"{path}: {key} holds {value.numel()} values, the response lengths say {sum(sizes)}")
    return list(torch.split(value, sizes))


def _group(t: dict[str, torch.Tensor], g: int, path: Path) -> pf.RolloutGroup:
    """Group ``g`` of a step file, validated (lengths, dtypes, finite values, token ids)."""
    missing = [k for k in GROUP_TENSORS[:-1] if f"g{g}.{k}" not in t]
    if missing:
        raise TraceError(f"{path}: lacks tensor g{g}.{missing[0]}")
    lens = t[f"g{g}.response_lens"]
    if lens.dtype != torch.int64 or lens.dim() != 1 or lens.numel() == 0 or bool((lens < 1).any()):
        raise TraceError(f"{path}: g{g}.response_lens must be a 1-D int64 tensor of positive lengths")
    sizes = lens.tolist()
    responses = _split(t, f"g{g}.responses", sizes, path)
    old = _split(t, f"g{g}.old_logprobs", sizes, path)
    ref = _split(t, f"g{g}.ref_logprobs", sizes, path)
    masks = t.get(f"g{g}.loss_masks")
    if masks is not None and masks.dtype != torch.bool:
        raise TraceError(f"{path}: g{g}.loss_masks must be a bool tensor (True where a token is trained)")
    masks = _split(t, f"g{g}.loss_masks", sizes, path)
    try:
        return pf.RolloutGroup(
            t[f"g{g}.prompt"], responses, t[f"g{g}.advantages"], old, ref, loss_masks=masks
        )
    except (ValueError, TypeError) as e:
        raise TraceError(f"{path}: group {g} is invalid: {e}") from None


def _how_to_write(folder: Path) -> str:
    """For a missing ``OUT/<spec>/<preset>/_state/traces/<name>``: the command that writes it (traces are not
    committed: ``results/*/*/_state/`` is ignored, so a fresh clone has none)."""
    parts = folder.parts
    if len(parts) < 5 or parts[-3:-1] != ("_state", "traces"):
        return ""
    out = Path(*parts[:-5]) if len(parts) > 5 else Path(".")
    spec, preset = parts[-5], parts[-4]
    preset_flag = "" if preset == "default" else f" --preset {preset}"
    return (
        f"; traces are not committed: `pf-bench rl experiments/{spec}.yaml{preset_flag} --out {out}` writes it "
        "(--preset smoke: small traces in a few minutes)"
    )


def load_trace(folder: str | Path) -> Trace:
    """Open and validate a trace folder (manifest schema, file names); raises :class:`TraceError`."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TraceError(f"{folder}: not a trace folder (no such directory){_how_to_write(folder)}")
    path = folder / "manifest.json"
    raw = read_json(path)
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise TraceError(f"{path}: invalid manifest at {loc}: {first['msg']}") from None
    numbers = [s.step for s in manifest.steps]
    if numbers != list(range(1, len(numbers) + 1)):
        raise TraceError(f"{path}: steps must be numbered 1..{len(numbers)} in order")
    return Trace(folder, manifest)


def nan_max(a: float, b: float) -> float:
    """``max`` that keeps NaN: Python's ``max(x, nan)`` returns ``x``, so a NaN difference would read as 0."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _compare(
    ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], source: Path
) -> dict[str, float]:
    worst, count, ok = 0.0, 0, True
    max_abs = max_ref = sq = 0.0
    abs_sum = ref_sq = 0.0
    for name, x in ours.items():
        y = theirs.get(f"w.{name}")
        if y is None or y.shape != x.shape:
            raise TraceError(f"{source}: lacks w.{name} of shape {tuple(x.shape)}")
        x, y = x.double(), y.double()
        d = (x - y).abs()
        bound = TAU_ABS + TAU_REL * torch.maximum(x.abs(), y.abs())
        ok &= bool((d <= bound).all())
        worst = nan_max(worst, float((d / bound).max()))
        max_abs = nan_max(max_abs, float(d.max()))
        max_ref = nan_max(max_ref, float(y.abs().max()))
        sq += float(d.pow(2).sum())
        abs_sum += float(d.sum())
        ref_sq += float(y.pow(2).sum())
        count += d.numel()
    return {
        "max_abs": max_abs,
        "rmse": (sq / count) ** 0.5,
        "mean_abs": abs_sum / count,
        "param_scale": max_ref,
        "param_rms": (ref_sq / count) ** 0.5,
        "max_rel": max_abs / max_ref if max_ref and not math.isnan(max_ref) else float("nan"),
        "tau_pass": ok,
        "tau_worst": worst,
    }


def replay_trace(
    trace: Trace,
    system: str,
    device: str | torch.device = "cpu",
    on_step=None,
    fp64: bool = False,
    ranks=None,
) -> list[dict[str, Any]]:
    """Replay every step of ``trace`` with ``system`` (a trainer: ``harness.rl.trainers.TRAINERS``); one dict
    per step with the weight differences to the
    source run after that step (max / RMSE / mean absolute, relative max, the bf16 tau rule).

    ``fp64``: replay in float64 (weights, AdamW state, compute) an fp32 trace: the difference is then the
    source run's own fp32 rounding, amplified by the optimizer as any fp32 trainer's would be (the floor
    against which another fp32 trainer's replay is read). ``ranks`` (``harness.rl.ranks.Ranks``): replay
    on the loop's parallel layout, every rank calling this (each returns the same rows)."""
    from prefixflow.model.dtypes import DTYPES

    m = trace.manifest
    if system not in TRAINERS:
        raise ValueError(f"system {system!r} unknown; valid: {', '.join(TRAINERS)}")
    if fp64 and m.dtype != "fp32":
        raise ValueError(f"an fp64 replay measures an fp32 trace's rounding; {trace.name} is {m.dtype}")
    weights_dtype = torch.float64 if fp64 else torch.float32
    device = torch.device(device)
    manifest_path = trace.folder / "manifest.json"
    try:  # on the meta device first: the trace's weights must fit the model it names before any allocation
        meta = pf.build_model(m.model, dtype=torch.float32, seed=m.seed, overrides=m.overrides, device="meta")
    except (ValueError, TypeError) as e:
        raise TraceError(f"{manifest_path}: cannot build its model: {e}") from None
    shapes = {name: tuple(p.shape) for name, p in named_parameters(meta).items()}
    initial_path = trace.folder / m.initial.file
    initial = trace.tensors(m.initial)
    held = {k.removeprefix("w."): tuple(v.shape) for k, v in initial.items() if k.startswith("w.")}
    if held != shapes:
        raise TraceError(f"{initial_path}: its weights do not match the model {m.model} the manifest names")
    model = pf.build_model(m.model, dtype=weights_dtype, seed=m.seed, overrides=m.overrides, device=device)
    pf.apply_prefixflow(model, pf.PrefixFlowConfig(attention=m.attention))
    if ranks is not None:
        model = ranks.parallelize(model)
    o = m.optimizer
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=m.steps[0].lr,
        betas=o.betas,
        eps=o.eps,
        weight_decay=o.weight_decay,
        fused=o.fused,
    )
    initial = {k: v.to(weights_dtype) if k.startswith("w.") else v for k, v in initial.items()}
    load_weights(model, initial, initial_path, prefix="w.")
    load_optimizer(model, opt, initial, initial_path)
    compute = DTYPES[m.dtype]
    rows = []
    for step in m.steps:
        train_system, inputs = trainer_inputs(system, trace.groups(step))
        stats = actor_update(
            model,
            inputs,
            opt,
            system=train_system,
            lr=step.lr,
            layout=m.layout,
            microbatch=m.microbatch,
            loss_config=dict(m.loss_config),
            max_grad_norm=o.max_grad_norm,
            compute_dtype=None if compute == torch.float32 else compute,
        )
        after = trace.tensors(step.after)
        row = {
            "step": step.step,
            "replay_dtype": "fp64" if fp64 else m.dtype,
            "lr": step.lr,
            "loss": stats.loss,
            "source_loss": step.loss,
            **_compare(state_tensors(model), after, trace.folder / step.after.file),
        }
        rows.append(row)
        if on_step is not None:
            on_step(row)
    return rows
