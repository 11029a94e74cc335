"""The real CPU offload tier with no work on its worker thread, for tests that compare real peaks with fake
ones (the fake tier frees a storage at once and loads at once): each copy out is written before ``store``
returns and each load read before ``start_load`` returns, so no bytes are in flight and no storage dies late
on the worker thread."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from prefixflow.memory import storage


def _store(self, slot, t) -> None:
    slot.where, self.size = self.size, self.size + slot.nbytes
    self._write(storage.bytes_of(t), slot.where)


def _start_load(self, slot) -> None:
    slot.data = torch.empty(slot.nbytes, dtype=torch.uint8)
    self._read(slot.data, slot.where)
    slot.pending = Future()
    slot.pending.set_result(None)


def inline_tier_methods() -> dict:
    """``storage.FilePool``'s methods to replace (name -> function)."""
    return {"store": _store, "start_load": _start_load}
