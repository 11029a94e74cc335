"""Checkpoints and trace files: safetensors + JSON only, written atomically, verified on read.

Under ``torch.distributed`` only global rank 0 writes (the others return the path and write nothing): the
loop's ranks hold the same gathered tensors and records, and every rank still calls the gathers
(:func:`state_tensors`, :func:`optimizer_tensors`) that precede a write.

Everything read back here is untrusted data: no pickle, a file is refused with a one-line
:class:`TraceError` naming it when it is unreadable, truncated, not what its manifest's SHA-256 says, or
holds tensors of the wrong name, dtype or shape.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from harness.records import RECORD_SUFFIX, write_records
from harness.safe_fs import atomic_write
from prefixflow.rl import named_parameters

__all__ = [
    "TraceError",
    "writes_here",
    "atomic_write_bytes",
    "save_tensors",
    "load_tensors",
    "sha256_of",
    "state_tensors",
    "load_weights",
    "optimizer_tensors",
    "load_optimizer",
    "read_json",
    "write_json",
    "write_rl_records",
]

MAX_JSON_BYTES = 16 * 2**20


class TraceError(ValueError):
    """A trace or checkpoint file is missing, damaged or inconsistent; the message names the file."""


def writes_here() -> bool:
    """Whether this process writes files: one process, or global rank 0 of a process group."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def atomic_write_bytes(path: str | Path, data: bytes, root: str | Path | None = None) -> Path:
    """Write ``data`` atomically (harness.safe_fs: a fresh temp file, fsync, rename; no link below ``root``
    is followed). On a rank other than 0, nothing."""
    if not writes_here():
        return Path(path)
    return atomic_write(path, lambda fh: fh.write(data), root=root)


def write_json(path: str | Path, data: Any, root: str | Path | None = None) -> Path:
    return atomic_write_bytes(path, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode(), root)


def read_json(path: str | Path) -> Any:
    path = Path(path)
    try:
        if path.is_symlink() or not path.is_file():
            raise TraceError(f"{path}: missing (or not a regular file)")
        if path.stat().st_size > MAX_JSON_BYTES:
            raise TraceError(f"{path}: larger than {MAX_JSON_BYTES} bytes; not a manifest")
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceError(f"{path}: unreadable JSON ({type(e).__name__}: {e})") from None


def save_tensors(
    path: str | Path,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str] | None = None,
    root: str | Path | None = None,
) -> Path:
    """Write ``tensors`` (contiguous CPU copies) to a safetensors file atomically (see
    :func:`atomic_write_bytes`)."""
    if not writes_here():
        return Path(path)
    data = save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, metadata=metadata)
    return atomic_write_bytes(path, data, root)


def write_rl_records(path: str | Path, rows: list[dict[str, Any]], root: str | Path | None = None) -> Path:
    """Write Claim-2 rows as one pf-bench record file: its cell id is the file name (as
    :func:`harness.records.read_records` verifies), rows told apart by ``step``/``system``."""
    path = Path(path)
    if not writes_here():
        return path
    cell = path.name.removesuffix(RECORD_SUFFIX)
    return write_records(path, [{**r, "cell_id": cell} for r in rows], root)


def sha256_of(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_tensors(
    path: str | Path, sha256: str | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a safetensors file (and check its SHA-256 when given); returns (tensors, metadata)."""
    path = Path(path)
    if path.is_symlink() or not path.is_file():
        raise TraceError(f"{path}: missing (or not a regular file)")
    if sha256 is not None and sha256_of(path) != sha256:
        raise TraceError(f"{path}: SHA-256 does not match the manifest (corrupted or replaced file)")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            metadata = dict(fh.metadata() or {})
            tensors = {name: fh.get_tensor(name) for name in fh.keys()}
    except Exception as e:  # safetensors raises its own error types for bad headers / truncation
        raise TraceError(f"{path}: not a valid safetensors file ({type(e).__name__}: {e})") from None
    return tensors, metadata


def _whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole and on the CPU: a sharded (DTensor) tensor is gathered (a collective: every rank calls
    it) one tensor at a time, so a GPU never holds more than one whole parameter for a checkpoint."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).cpu()


def _placed_like(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A whole tensor ``t`` laid out as ``p``: sharded like a DTensor ``p`` (every rank passes the same ``t``)."""
    if isinstance(p, DTensor):
        return distribute_tensor(t.to(p.device_mesh.device_type), p.device_mesh, p.placements)
    return t


def state_tensors(model: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """The model's parameters by clean name, on the CPU (fp32 master weights as they are). A parallel
    (TP/FSDP2) model's sharded parameters are gathered whole: every rank must call this."""
    return {prefix + name: _whole(p.detach()) for name, p in named_parameters(model).items()}


@torch.no_grad()
def load_weights(
    model: nn.Module, tensors: dict[str, torch.Tensor], source: str | Path, prefix: str = ""
) -> None:
    """Copy ``prefix + name`` tensors into the model's parameters; every name, shape and dtype must match. A
    parallel model's sharded parameters take their shard of the whole tensor (every rank passes the same)."""
    params = named_parameters(model)
    for name, p in params.items():
        t = tensors.get(prefix + name)
        if t is None:
            raise TraceError(f"{source}: lacks parameter {prefix + name!r}")
        if t.shape != p.shape or t.dtype != p.dtype:
            raise TraceError(
                f"{source}: {prefix + name} is {t.dtype} {tuple(t.shape)}, the model wants {p.dtype} {tuple(p.shape)}"
            )
        if not torch.isfinite(t).all():
            raise TraceError(f"{source}: {prefix + name} holds NaN or inf")
        p.copy_(_placed_like(t, p))


_ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")


def optimizer_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """AdamW state as ``opt.<key>.<param name>`` tensors (empty before the first step); a parallel model's
    sharded state is gathered whole, like :func:`state_tensors`."""
    out = {}
    for name, p in named_parameters(model).items():
        state = optimizer.state.get(p)
        if not state:
            continue
        for key in _ADAM_KEYS:
            value = state[key]
            out[f"opt.{key}.{name}"] = (
                _whole(value) if isinstance(value, torch.Tensor) else torch.tensor(float(value))
            )
    return out


@torch.no_grad()
def _check_adam_state(key: str, t: torch.Tensor, where: str) -> None:
    """Refuse AdamW state that is finite but impossible: its first step would turn the weights NaN."""
    if key == "step":
        step = float(t)
        if step < 0 or step != int(step):
            raise TraceError(f"{where} is {step:g}: an AdamW step count is a whole number >= 0")
    elif key == "exp_avg_sq" and t.numel() and float(t.min()) < 0:
        raise TraceError(
            f"{where} has negative values (min {float(t.min()):g}): AdamW's second moment is >= 0"
        )


def load_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], source: str | Path
) -> None:
    """Restore AdamW state written by :func:`optimizer_tensors` (all parameters or none). A fused AdamW keeps
    its step counts on the parameters' device, the others on the CPU (as ``torch.optim.AdamW`` does)."""
    fused = bool(optimizer.param_groups[0].get("fused"))
    params = named_parameters(model)
    present = [name for name in params if f"opt.step.{name}" in tensors]
    if not present:
        return
    if len(present) != len(params):
        raise TraceError(f"{source}: optimizer state covers {len(present)} of {len(params)} parameters")
    for name, p in params.items():
        state = {}
        for key in _ADAM_KEYS:
            t = tensors.get(f"opt.{key}.{name}")
            if t is None:
                raise TraceError(f"{source}: lacks optimizer tensor opt.{key}.{name}")
            want = () if key == "step" else tuple(p.shape)
            if tuple(t.shape) != want or not torch.isfinite(t).all():
                raise TraceError(
                    f"{source}: opt.{key}.{name} has shape {tuple(t.shape)} (want {want}) or non-finite values"
                )
            _check_adam_state(key, t, f"{source}: opt.{key}.{name}")
            if key == "step":
                state[key] = t.to(torch.float32).to(p.device if fused else "cpu").clone()
            else:
                state[key] = _placed_like(t.to(p.dtype).clone(), p)
        optimizer.state[p] = state
