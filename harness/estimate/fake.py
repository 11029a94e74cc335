"""The fake world of one estimated cell: its FakeTensorMode, a model materialised in it from the meta device,
the guard against real allocations, and the meter that reads fake storages.

- **Models** are built on the meta device (no values, no init: ``build_model(device="meta")``, an HF model
  under ``torch.device("meta")``) and :func:`materialise`\\ d: every parameter and buffer becomes a fake tensor
  of the same shape, stride and dtype on the fake device ``cpu`` (tied weights stay tied). Offload gets the
  fake tier (``PrefixFlowConfig(offload_tier="fake")``).
- **Real tensors** may still be made: the group's host work (validation, positions, index tensors:
  ``prefixflow.schedule.host``) runs on the caller's real tensors. :class:`RealTensorGuard` refuses any of
  them above ``limit`` bytes, naming the op, so nothing of the model's size is ever allocated.
- **The meter** is the live-bytes meter over fake storages (device ``meta``) and real host tensors (``cpu``),
  so a phase's peak counts what a real CPU run counts.
"""

from __future__ import annotations

import dataclasses
import math
import os
import traceback

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
    is_fake,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from harness.records import ESTIMATE_METER
from harness.run.measure import PhaseMeter
from prefixflow.memory.live_bytes import LiveBytesMeter

__all__ = ["FAKE_METER", "REAL_LIMIT", "real_limit", "RealTensorGuard", "RealTensorError", "FakePhaseMeter", "fake_mode",
           "materialise", "use_fake_tier", "refusal_of", "fail"]  # fmt: skip

FAKE_METER = ESTIMATE_METER
REAL_LIMIT = 1 << 20  # positions, masks and RNG state may stay real below this
INDEX_BYTES_PER_TOKEN = 16  # a token's id and position as int64: host index work grows with the tokens


def real_limit(tokens: int) -> int:
    """The guard's limit for a step of ``tokens`` tokens: 1 MiB, or the step's index tensors (16 bytes a
    token) when more, so a 128k-token group's ids may stay real. A model's activation is thousands of bytes
    a token (``dim`` x the dtype), so none passes."""
    return max(REAL_LIMIT, INDEX_BYTES_PER_TOKEN * int(tokens))


class RealTensorError(RuntimeError):
    """A real tensor above the limit was made during an estimate (``op``: the op that made it)."""

    def __init__(self, op: str, nbytes: int, limit: int) -> None:
        self.op, self.nbytes = op, nbytes
        super().__init__(
            f"{op} made a real tensor of {nbytes / 2**20:.1f} MiB during the estimate (limit {limit / 2**20:.1f} MiB)"
        )


class RealTensorGuard(TorchDispatchMode):
    """Refuses every real (non-fake, non-meta) tensor above ``limit`` bytes that an op returns under it."""

    def __init__(self, limit: int = REAL_LIMIT) -> None:
        super().__init__()
        self.limit = limit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and not is_fake(leaf) and leaf.device.type != "meta":
                nbytes = leaf.untyped_storage().nbytes()
                if nbytes > self.limit:
                    raise RealTensorError(str(func), nbytes, self.limit)
        return out


def fake_mode() -> FakeTensorMode:
    """The cell's mode: real inputs (the group's host tensors) are taken as fake where an op meets them."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def materialise(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """Replace every meta parameter and buffer of ``model`` by a fake tensor of the same geometry on ``cpu``
    (in place; shared tensors stay shared). A non-meta tensor is refused: a real one would stay real."""
    made: dict[int, torch.Tensor] = {}

    def fake_of(t: torch.Tensor, name: str) -> torch.Tensor:
        if t.device.type != "meta":
            raise ValueError(f"{name} is on {t.device}, not the meta device; an estimate builds on meta only")
        if id(t) not in made:
            with mode:
                made[id(t)] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
        return made[id(t)]

    params: dict[int, nn.Parameter] = {}
    for mod_name, module in model.named_modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                if id(p) not in params:
                    params[id(p)] = nn.Parameter(
                        fake_of(p, f"{mod_name}.{name}"), requires_grad=p.requires_grad
                    )
                module._parameters[name] = params[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = fake_of(b, f"{mod_name}.{name}")
    return model


def use_fake_tier(model: nn.Module) -> None:
    """Give a PrefixFlow-wrapped model's offload the fake tier (``prefixflow.memory.fake_tier``)."""
    from prefixflow import apply_prefixflow
    from prefixflow.runtime import runtime_of

    runtime = runtime_of(model, create=True)
    if runtime is not None and runtime.config is not None:
        apply_prefixflow(model, dataclasses.replace(runtime.config, offload_tier="fake"))


class FakePhaseMeter(PhaseMeter):
    """:class:`~harness.run.measure.PhaseMeter` over fake storages and real host tensors; its times are not
    a device's (NaN in the record: an estimate measures memory and FLOPs only)."""

    def __init__(self, model: nn.Module | None = None) -> None:
        super().__init__("cpu", model=None, track_memory=True)
        self.live = LiveBytesMeter(("meta", "cpu"))
        self.mem_meter = FAKE_METER
        if model is not None:
            self.live.register(model)

    def results(self, extended: bool = False) -> dict:
        res = super().results(extended)
        for key in ("phase_a_s", "phase_b_s", "phase_c_s", "step_time_s"):
            res[key] = math.nan
        if extended:
            res["phase_times_s"] = {}
        return res


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _where(exc: BaseException) -> str:
    """The innermost frame of this repository's code in ``exc``'s traceback, as ``path:line``."""
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__)
        if f.filename.startswith(_ROOT) and "site-packages" not in f.filename  # not a venv inside the repository
        and f.name != "__torch_dispatch__"  # not the meters' and guard's modes
    ]  # fmt: skip
    return f" (at {os.path.relpath(frames[-1].filename, _ROOT)}:{frames[-1].lineno})" if frames else ""


def refusal_of(exc: BaseException, cell_id: str) -> str | None:
    """The one-line refusal of a shape an estimate cannot run (no fake kernel, a value-dependent decision, a
    real tensor above the limit), naming the op and the cell; None for any other error (a bug: its
    traceback is kept)."""
    if isinstance(exc, RealTensorError):
        return f"cell {cell_id}: cannot be estimated: {exc}{_where(exc)}"
    if isinstance(exc, DataDependentOutputException | DynamicOutputShapeException):
        what = (
            "reads tensor values"
            if isinstance(exc, DataDependentOutputException)
            else "has a value-dependent shape"
        )
        return (
            f"cell {cell_id}: cannot be estimated: {exc.func} {what}, which fake tensors have not "
            f"(data-dependent control flow){_where(exc)}"
        )
    if isinstance(exc, UnsupportedOperatorException):
        return f"cell {cell_id}: cannot be estimated: {exc.func} has no fake (meta) kernel{_where(exc)}"
    return None


def fail(run, exc: BaseException, cell, device) -> None:
    """Record ``exc`` on ``run``: ``refused`` with the one-line reason for a shape an estimate cannot run,
    else as the measurement loop records a failure (status and traceback)."""
    message = refusal_of(exc, cell.cell_id)
    run.fail(exc, device)
    if message is not None:
        run.failure = ("refused", message)
