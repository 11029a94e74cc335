"""Offload of what selective activation checkpointing keeps (``prefixflow.memory.offload``).

Op-level SAC (``torch.utils.checkpoint.create_selective_checkpoint_contexts``, TorchTitan's ``selective``) does
not save the outputs of the ops its policy keeps through autograd's saved-tensor hooks: its caching dispatch
mode stores them in a dictionary of its own, read back by the recompute in the backward. Offload's hooks never
see them, so under SAC they stayed resident through Phase B. ``sac_offloading`` wraps the ``context_fn`` of
every checkpointed module of the model for the prefix forward: the two modes it returns share a cache whose
entries go through the offload's own pack and unpack (same slots, tiers, version checks, prefetch order),
packed when SAC stores them and unpacked when the recompute reads them. Bytes and numbers are unchanged.

The cache keeps the access patterns of both torch layouts: ``{op: {index: entry}}`` (torch >= 2.12:
``[index] = entry``, ``.get(index)``) and ``{op: [entry, ...]}`` (earlier: ``.append``, ``.pop(0)``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import _VersionWrapper

__all__ = ["sac_offloading"]


class _Entries:
    """One op's SAC entries, each cached tensor held as the offload's packed record until it is read."""

    def __init__(self, pack: Callable, unpack: Callable, resident: bool = False) -> None:
        self._pack, self._unpack, self.resident = pack, unpack, resident
        self._items: dict = {}
        self._next = 0

    def _packed(self, entry):
        if self.resident:
            return entry

        def leaf(x):
            if isinstance(x, _VersionWrapper) and isinstance(x.val, torch.Tensor):
                x.val = self._pack(x.val)
            return x

        return tree_map(leaf, entry)

    def _unpacked(self, entry):
        def leaf(x):
            if (
                isinstance(x, _VersionWrapper)
                and x.version is not None
                and not isinstance(x.val, torch.Tensor)
            ):
                x.val = self._unpack(x.val)  # the offload checks the version saved at pack time
                x.version = x.val._version
            return x

        return tree_map(leaf, entry)

    # torch >= 2.12: index -> entry
    def __setitem__(self, index, entry) -> None:
        self._items[index] = self._packed(entry)

    def get(self, index, default=None):
        entry = self._items.get(index, default)
        return entry if entry is default else self._unpacked(entry)

    # earlier torch: a list consumed from the front
    def append(self, entry) -> None:
        self._items[self._next] = self._packed(entry)
        self._next += 1

    def pop(self, position: int = -1):
        keys = list(self._items)
        return self._unpacked(self._items.pop(keys[position]))

    def __len__(self) -> int:
        return len(self._items)


class _Cache(dict):
    """SAC's ``{op: entries}``, each op's entries made on first use. A functional collective's output
    (``_c10d_functional``, e.g. TP's reduce-scatter, which TorchTitan's policy saves) stays resident: SAC stores
    it before its ``wait_tensor``, and a copy out then could read bytes the collective has not written yet."""

    def __init__(self, pack: Callable, unpack: Callable) -> None:
        super().__init__()
        self._pack, self._unpack = pack, unpack

    def __missing__(self, op) -> _Entries:
        entries = self[op] = _Entries(
            self._pack, self._unpack, getattr(op, "namespace", "") == "_c10d_functional"
        )
        return entries


def _checkpointed(model: nn.Module) -> list[nn.Module]:
    """Modules whose checkpoint function carries a SAC ``context_fn`` (TorchTitan's ``CheckpointWrapper``)."""
    found = []
    for m in model.modules():
        fn = getattr(m, "checkpoint_fn", None)
        if isinstance(fn, functools.partial) and fn.keywords.get("context_fn") is not None:
            found.append(m)
    return found


@contextlib.contextmanager
def sac_offloading(model: nn.Module, pack: Callable, unpack: Callable) -> Iterator[None]:
    """For the enclosed forward, every SAC cache of ``model`` holds its tensors through ``pack``/``unpack``."""
    modules = _checkpointed(model)
    saved = [m.checkpoint_fn for m in modules]

    def wrap(context_fn):
        def offloaded_context():
            forward, recompute = context_fn()
            if hasattr(forward, "storage") and hasattr(recompute, "storage"):
                cache = _Cache(pack, unpack)
                forward.storage = recompute.storage = cache
            return forward, recompute

        return offloaded_context

    try:
        for m, fn in zip(modules, saved, strict=True):
            m.checkpoint_fn = functools.partial(
                fn.func, *fn.args, **{**fn.keywords, "context_fn": wrap(fn.keywords["context_fn"])}
            )
        yield
    finally:
        for m, fn in zip(modules, saved, strict=True):
            m.checkpoint_fn = fn
