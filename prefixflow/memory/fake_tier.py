"""The offload tier of an estimate (``PrefixFlowConfig(offload_tier="fake")``): the same schedule of stores and
loads as the real tiers, under ``torch._subclasses.fake_tensor.FakeTensorMode``, with no bytes anywhere.

A fake storage has no data and no address (``data_ptr()`` is 0 for all of them), so the tier works by storage
identity: a store keeps nothing, so the storage dies when autograd's last reference does, as a real tier's
copy out frees it; a load allocates the slot's bytes where the real tiers do (a fake ``uint8`` storage of
the same size, counted by the meters); the saved tensor is rebuilt as a view of them (``set_`` would move a
fake tensor onto a storage of another device). Loads are immediate: nothing is late or in flight.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .storage import Slot

__all__ = ["TIER_FAKE", "FakePool"]

TIER_FAKE = "fake"


class FakePool:
    """The fake tier: identity by storage, loads as fake allocations, views instead of ``set_``."""

    tier = TIER_FAKE

    def __init__(self) -> None:
        self.size = 0

    @staticmethod
    def plain(t: torch.Tensor) -> bool:
        """A fake tensor of the estimate (no further subclass, e.g. a DTensor's wrapper)."""
        return type(t) is FakeTensor

    @staticmethod
    def key(storage: torch.UntypedStorage) -> int:
        return storage._cdata  # the storage itself: fake storages share data_ptr 0

    @staticmethod
    def resident(t: torch.Tensor) -> torch.Tensor:
        whole = t.untyped_storage().nbytes() // t.element_size()
        return t.detach().as_strided((whole,), (1,), 0).view(torch.uint8)

    @staticmethod
    def rebuild(data: torch.Tensor, dtype, offset: int, size, stride) -> torch.Tensor:
        return data.view(dtype).as_strided(size, stride, offset)

    def store(self, slot: Slot, t: torch.Tensor) -> None:
        slot.where, self.size = self.size, self.size + slot.nbytes  # keeps no reference to t

    def finish_stores(self) -> None:
        pass

    def start_load(self, slot: Slot) -> None:
        slot.data = torch.empty(slot.nbytes, dtype=torch.uint8)  # fake under the estimate's mode

    def complete_load(self, slot: Slot) -> bool:
        return True

    def abandon(self, slot: Slot) -> bool:
        return True

    def load_now(self, slot: Slot) -> None:
        self.start_load(slot)

    def capacity(self) -> int:
        return self.size

    def close(self) -> None:
        pass
