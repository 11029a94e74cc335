"""``apply_compile``: TorchTitan-style per-block ``torch.compile`` that both systems share.

Every TransformerBlock gets a compiled forward (inductor; ``fullgraph=True`` by default, as TorchTitan does).
The baseline and PrefixFlow's Phase B run the compiled blocks; Phase A (a node's forward captures its live
K/V and creates grad-requiring leaves, Python side effects a graph cannot hold) runs the *eager* block, as the
paper's prototype does, and Phase C is a plain autograd backward through Phase A's eager graph.

The switch is a per-block dispatcher: while the model's attention mode captures (``NodeAttention`` with a
``capture`` cache) the block's original forward runs, otherwise the compiled one. The attention mode objects
are read *inside* the compiled block (dynamo guards on their type and the attributes read), so the
concat/split/masked variants each get their own graph and no graph break.

Compile time is paid by the first call of each new graph; :func:`first_call_seconds` measures it apart from
step time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from ..runtime import runtime_of
from .adapters import adapter_for

__all__ = ["apply_compile", "is_compiled", "first_call_seconds"]


class _BlockDispatch:
    """The per-block forward after ``apply_compile``: compiled, or eager while the attention mode captures."""

    def __init__(self, eager: Callable, compiled: Callable, state) -> None:
        self.eager, self.compiled, self.state = eager, compiled, state

    def __call__(self, *args, **kwargs):
        mode = None if self.state is None else self.state.mode
        if getattr(mode, "capture", None) is not None:
            return self.eager(*args, **kwargs)
        return self.compiled(*args, **kwargs)


def apply_compile(
    model: nn.Module,
    *,
    fullgraph: bool = True,
    backend: str = "inductor",
    **compile_kwargs,
) -> nn.Module:
    """Compile every TransformerBlock of a TorchTitan model in place (after ``apply_ac``/``apply_prefixflow``).

    Parameter names and ``model.parameters()`` are unchanged (the block modules stay in place; only their
    ``forward`` is dispatched). Works on plain models too (no PrefixFlow state: always compiled).
    Raises if the model is already compiled.
    """
    if is_compiled(model):
        raise ValueError("apply_compile was already applied to this model")
    runtime = runtime_of(model, create=True)
    state = runtime.state
    for block in adapter_for(model).blocks(model):
        eager = block.forward
        compiled = torch.compile(eager, fullgraph=fullgraph, backend=backend, **compile_kwargs)
        block.forward = _BlockDispatch(eager, compiled, state)
    runtime.compiled = {"fullgraph": fullgraph, "backend": backend}
    return model


def is_compiled(model: nn.Module) -> bool:
    return runtime_of(model, create=True).compiled is not None


def first_call_seconds(fn: Callable, *args, **kwargs) -> tuple[float, object]:
    """``(seconds, result)`` of one call; on a freshly compiled model this is compile + one step."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, result
