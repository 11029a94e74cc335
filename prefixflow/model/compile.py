"""``apply_compile``: TorchTitan-style per-block ``torch.compile`` that both systems share.

Every TransformerBlock gets a compiled forward (inductor; ``fullgraph=True`` by default, as TorchTitan does).
The baseline and PrefixFlow's Phase B run the compiled blocks; Phase A (prefix capture: it registers
live K/V and creates grad-requiring leaves, Python side effects a graph cannot hold) runs the *eager* block,
as the paper's prototype does, and Phase C is a plain autograd backward through Phase A's eager graph.

The switch is a per-block dispatcher: when the model's PrefixFlow attention mode is one of
``eager_modes`` (``CapturePrefix`` by default) the block's original forward runs, otherwise the compiled one.
The attention mode objects are read *inside* the compiled block (dynamo guards on their type and the
attributes read), so the concat/split/masked variants each get their own graph and no graph break.

Compile time is paid by the first call of each new graph; :func:`first_call_seconds` measures it apart from
step time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from ..attention.modes import CapturePrefix
from .adapters import adapter_for

__all__ = ["apply_compile", "is_compiled", "first_call_seconds"]


class _BlockDispatch:
    """The per-block forward after ``apply_compile``: compiled, or eager while an eager mode is active."""

    def __init__(self, eager: Callable, compiled: Callable, state, eager_modes: tuple[type, ...]) -> None:
        self.eager, self.compiled, self.state, self.eager_modes = eager, compiled, state, eager_modes

    def __call__(self, *args, **kwargs):
        mode = None if self.state is None else self.state.mode
        if isinstance(mode, self.eager_modes):
            return self.eager(*args, **kwargs)
        return self.compiled(*args, **kwargs)


def apply_compile(
    model: nn.Module,
    *,
    fullgraph: bool = True,
    backend: str = "inductor",
    eager_modes: tuple[type, ...] = (CapturePrefix,),
    **compile_kwargs,
) -> nn.Module:
    """Compile every TransformerBlock of a TorchTitan model in place (after ``apply_ac``/``apply_prefixflow``).

    Parameter names and ``model.parameters()`` are unchanged (the block modules stay in place; only their
    ``forward`` is dispatched). Works on plain models too (no PrefixFlow state: always compiled).
    Raises if the model is already compiled.
    """
    if is_compiled(model):
        raise ValueError("apply_compile was already applied to this model")
    runtime = getattr(model, "_prefixflow", None)
    state = None if runtime is None else runtime.state
    for block in adapter_for(model).blocks(model):
        eager = block.forward
        compiled = torch.compile(eager, fullgraph=fullgraph, backend=backend, **compile_kwargs)
        block.forward = _BlockDispatch(eager, compiled, state, tuple(eager_modes))
    model.prefixflow_compiled = {"fullgraph": fullgraph, "backend": backend}
    return model


def is_compiled(model: nn.Module) -> bool:
    return getattr(model, "prefixflow_compiled", None) is not None


def first_call_seconds(fn: Callable, *args, **kwargs) -> tuple[float, object]:
    """``(seconds, result)`` of one call; on a freshly compiled model this is compile + one step."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, result
