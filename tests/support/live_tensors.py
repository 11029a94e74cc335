"""What the garbage collector still reaches: the leak checks of the core and the hybrid lifecycle tests."""

from __future__ import annotations

import gc

import torch


def live_tensor_bytes() -> tuple[int, int]:
    """(count, bytes) of distinct tensor storages reachable by the garbage collector."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type != "meta":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return len(storages), sum(storages.values())
