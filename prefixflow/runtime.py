"""The one object that holds PrefixFlow's state of a model: :class:`PrefixFlowRuntime`, reached only through
:func:`runtime_of`.

Every transformation (``apply_prefixflow``, ``apply_ac``, ``apply_compile``, ``apply_moe``, ``apply_pp``,
``parallelize`` and its parts, ``build_model``) records what it did here, and the schedule reads it here. The
model carries one attribute, ``_prefixflow`` (this object); nothing else of PrefixFlow's is set on a module.
The wrappers users put around a model do not hide it: :func:`runtime_of` looks through ``torch.compile``'s
``OptimizedModule`` and PEFT's ``PeftModel`` to the module they wrap (``fully_shard`` keeps the module itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["PrefixFlowRuntime", "runtime_of", "unwrapped", "HANDLE"]

HANDLE = "_prefixflow"


@dataclass
class PrefixFlowRuntime:
    """PrefixFlow's state of one model.

    - ``config``, ``state``, ``n_wrapped``, ``adapter``: what ``apply_prefixflow`` set up (its
      ``PrefixFlowConfig``, the attention state its wrappers share, how many boundary layers it wrapped, the
      model family's adapter); ``config`` is None until it runs.
    - ``stage``: where the phases run (``None``: the whole model on this device; ``apply_pp``: its stage).
    - ``hooks``: the schedule hooks (``prefixflow.hooks``); ``moe``: the MoE hook ``apply_moe`` registered.
    - ``parallel``: what ``parallelize`` set up (``prefixflow.parallel.ParallelState``); ``tp``: the TP degree
      ``apply_tp`` used; ``fsdp``: FSDP2's collective counters.
    - ``ac``: the activation checkpointing mode; ``compiled``: ``apply_compile``'s options; ``name``: the
      name ``build_model`` built it from.
    - ``guard``: the non-finite guard's state while its outermost body runs (``prefixflow.schedule.grad_guard``).
    """

    config: Any = None
    state: Any = None
    n_wrapped: int = 0
    adapter: Any = None
    stage: Any = None
    hooks: Any = None
    moe: Any = None
    parallel: Any = None
    tp: int | None = None
    fsdp: Any = None
    ac: str | None = None
    compiled: dict | None = None
    name: str = ""
    guard: dict = field(default_factory=dict)

    def grad_kv_dtype(self, model: nn.Module) -> torch.dtype:
        """The dtype of the cached K/V leaves and their gradient accumulators (fp32 for a bf16/fp16 model)."""
        if self.config is not None and self.config.grad_kv_dtype is not None:
            return self.config.grad_kv_dtype
        dtype = next(model.parameters()).dtype
        return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def unwrapped(model: nn.Module) -> nn.Module:
    """The module a user's wrapper wraps: ``torch.compile``'s ``OptimizedModule`` (``_orig_mod``) and PEFT's
    ``PeftModel`` (its base model), repeatedly; any other module is itself."""
    while True:
        inner = model.__dict__.get("_modules", {}).get("_orig_mod")  # torch.compile(model)
        if inner is None and callable(getattr(type(model), "get_base_model", None)):
            inner = model.get_base_model()  # PEFT
        if inner is None or inner is model:
            return model
        model = inner


def runtime_of(model: nn.Module, *, create: bool = False) -> PrefixFlowRuntime:
    """The model's runtime. ``create=False`` (the schedule's use) raises unless ``apply_prefixflow`` ran on it;
    ``create=True`` (a transformation's use) makes an empty one if the model has none."""
    target = unwrapped(model)
    runtime = target.__dict__.get(HANDLE)
    if runtime is None and create:
        runtime = PrefixFlowRuntime()
        target.__dict__[HANDLE] = runtime  # a plain attribute: not a submodule, not in the state dict
    if not create and (runtime is None or runtime.config is None):
        raise ValueError(
            "this model has no PrefixFlow attention; call prefixflow.apply_prefixflow(model) first"
        )
    return runtime
