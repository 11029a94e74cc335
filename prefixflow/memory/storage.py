"""Where offloaded prefix tensors live (``prefixflow.memory.offload``): the records autograd keeps for saved tensors
(resident, or a slot holding one offloaded storage) and the two tiers the slots' bytes go to: an unlinked
temporary file on CPU, a pinned host pool on CUDA."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.distributed.tensor import DTensor

TIER_CUDA = "cuda-pinned"
TIER_CPU = "cpu-file"
POOL_HEADROOM = 1.5
MIN_PINNED_CHUNK = 64 << 20


def version_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor that shares ``t``'s version counter (so an in-place change to ``t``, its base or any view of it
    shows here) but holds no storage: the offloaded bytes can leave while the counter stays watched. The
    storage swap bumps the shared counter once; it is set back, so ``t`` reads the same version as before.
    A DTensor's alias is a DTensor over a storage-less shard: it watches the wrapper's counter, which an
    in-place op through the DTensor bumps (its shard's counter stays as it was)."""
    alias = t.detach()  # shares t's version counter
    inner = alias._local_tensor if isinstance(alias, DTensor) else alias
    version = inner._version
    empty = torch.empty(0, dtype=torch.uint8, device=inner.device)  # fake under an estimate
    inner.set_(empty.untyped_storage())
    torch._C._autograd._unsafe_set_version_counter((inner,), (version,))
    return alias


def check_version(watched: torch.Tensor, saved_version: int, t_desc: str, where: str) -> None:
    """Raise as autograd does when a saved tensor was modified in place after it was saved."""
    if watched._version != saved_version:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{t_desc}], saved by the prefix forward ({where}), is at version {watched._version}; expected "
            f"version {saved_version} instead. (Saved tensors of the prefix graph must stay unchanged until "
            "Phase C's backward reads them.)"
        )


class Kept:
    """A saved tensor that stays resident, with the version it was saved at."""

    __slots__ = ("tensor", "version", "layer")

    def __init__(self, t: torch.Tensor, layer: int) -> None:
        self.tensor, self.version, self.layer = t.detach(), t._version, layer


class Slot:
    __slots__ = (
        "index", "layer", "nbytes", "version", "alias", "desc", "handles", "where", "data", "pending", "loaded",
    )  # fmt: skip

    def __init__(self, index: int, layer: int, t: torch.Tensor) -> None:
        self.index, self.layer = index, layer
        self.nbytes, self.version = t.untyped_storage().nbytes(), t._version
        self.alias = version_alias(t)  # watches in-place changes while the bytes are out
        self.desc = f"{t.dtype} {tuple(t.shape)}"
        self.handles = 0
        self.where = None  # tier location: file offset, or (pinned region, copy-out event)
        self.data = None  # the storage's bytes back on the device (uint8)
        self.pending = None  # an in-flight load (Future or CUDA event)
        self.loaded = False


class Packed:
    """What autograd stores instead of an offloaded tensor: its slot and its view geometry. ``on_drop(slot)``
    runs when autograd lets go of it (the slot's handle count is then the caller's to lower)."""

    __slots__ = ("on_drop", "slot", "dtype", "offset", "size", "stride")

    def __init__(self, on_drop: Callable[[Slot], None], slot: Slot, t: torch.Tensor) -> None:
        self.on_drop, self.slot, self.dtype = on_drop, slot, t.dtype
        self.offset, self.size, self.stride = t.storage_offset(), tuple(t.shape), t.stride()
        slot.handles += 1

    def __del__(self) -> None:
        self.on_drop(self.slot)


class ShardPacked:
    """An offloaded DTensor (TP, FSDP2): its local shard's ``Packed``, the wrapper's spec to rebuild it, and a
    storage-less alias watching the wrapper's version (the shard's own is the slot's)."""

    __slots__ = ("packed", "spec", "alias", "version")

    def __init__(self, packed: Packed, t: DTensor) -> None:
        self.packed, self.spec, self.alias, self.version = packed, t._spec, version_alias(t), t._version

    def rebuild(self, local: torch.Tensor) -> DTensor:
        return DTensor(local, self.spec, requires_grad=False)


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the whole storage of ``t`` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class RealTier:
    """What the real tiers share: which saved tensors they take, storage identity, the rebuilt view."""

    @staticmethod
    def plain(t: torch.Tensor) -> bool:
        """Whether ``t`` is a tensor this tier moves (a plain tensor or parameter, no subclass)."""
        return type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter)

    @staticmethod
    def key(storage: torch.UntypedStorage) -> int:
        return storage.data_ptr()

    @staticmethod
    def resident(t: torch.Tensor) -> torch.Tensor:
        """A slot's bytes read from the storage of ``t``, which stayed live (uint8 over all of it, no copy)."""
        return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())

    @staticmethod
    def rebuild(data: torch.Tensor, dtype, offset: int, size, stride) -> torch.Tensor:
        """The saved tensor over the loaded bytes ``data`` (uint8), with its exact view geometry."""
        return torch.empty(0, dtype=dtype, device=data.device).set_(data.untyped_storage(), offset, size, stride)


class FilePool(RealTier):
    """CPU tier: an unlinked temporary file, written and read by one worker thread."""

    tier = TIER_CPU

    def __init__(self) -> None:
        fd, path = tempfile.mkstemp(prefix="prefixflow-offload-", suffix=".bin")
        os.unlink(path)  # the name goes now; the space goes when the fd closes, even if the process dies
        self.fd, self.path, self.size = fd, path, 0
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefixflow-offload")
        self.writes: list = []

    def _write(self, src: torch.Tensor, offset: int) -> None:
        view, done = memoryview(src.numpy()), 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)

    def _read(self, dst: torch.Tensor, offset: int) -> None:
        view, done = memoryview(dst.numpy()), 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(f"offload file {self.path} ended early at byte {offset + done}")
            done += n

    def store(self, slot: Slot, t: torch.Tensor) -> None:
        slot.where, self.size = self.size, self.size + slot.nbytes
        self.writes.append(self.io.submit(self._write, bytes_of(t), slot.where))  # holds it until written

    def finish_stores(self) -> None:
        writes, self.writes = self.writes, []
        for w in writes:
            w.result()

    def start_load(self, slot: Slot) -> None:
        slot.data = torch.empty(slot.nbytes, dtype=torch.uint8)  # allocated here, where meters see it
        slot.pending = self.io.submit(self._read, slot.data, slot.where)

    def complete_load(self, slot: Slot) -> bool:
        """Wait for a started load; run it here if the worker has not begun it. True = it was already done."""
        if slot.pending.done():
            slot.pending.result()
            return True
        if slot.pending.cancel():
            self._read(slot.data, slot.where)
        else:
            slot.pending.result()
        return False

    def abandon(self, slot: Slot) -> bool:
        """A started load nobody will consume: cancel it if it has not begun. True = the bytes were read."""
        if slot.pending.cancel():
            return False
        slot.pending.result()
        return True

    def load_now(self, slot: Slot) -> None:
        self.finish_stores()
        slot.data = torch.empty(slot.nbytes, dtype=torch.uint8)
        self._read(slot.data, slot.where)

    def capacity(self) -> int:
        return self.size

    def close(self) -> None:
        self.io.shutdown(wait=True, cancel_futures=True)
        self.writes = []
        os.close(self.fd)
        self.fd = -1


class PinnedPool(RealTier):
    """CUDA tier: pinned host chunks (bump-allocated), copies on a side stream and a prefetch stream."""

    tier = TIER_CUDA

    def __init__(self, device: torch.device, hint: int) -> None:
        self.device = device
        self.out_stream = torch.cuda.Stream(device)
        self.in_stream = torch.cuda.Stream(device)
        self.chunks: list[list] = []  # [pinned uint8 tensor, bytes used]
        self.first = max(int(hint * POOL_HEADROOM), MIN_PINNED_CHUNK)

    def _region(self, nbytes: int) -> torch.Tensor:
        need = (nbytes + 511) // 512 * 512
        if not self.chunks or self.chunks[-1][1] + need > self.chunks[-1][0].numel():
            grow = self.first if not self.chunks else int(self.capacity() * (POOL_HEADROOM - 1))
            self.chunks.append([torch.empty(max(need, grow), dtype=torch.uint8, pin_memory=True), 0])
        chunk = self.chunks[-1]
        region, chunk[1] = chunk[0][chunk[1] : chunk[1] + nbytes], chunk[1] + need
        return region

    def store(self, slot: Slot, t: torch.Tensor) -> None:
        src = bytes_of(t)
        region = self._region(slot.nbytes)
        self.out_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.out_stream):
            region.copy_(src, non_blocking=True)
            src.record_stream(self.out_stream)  # the allocator reuses src only after this copy
            done = torch.cuda.Event()
            done.record(self.out_stream)
        slot.where = (region, done)

    def finish_stores(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.out_stream)

    def start_load(self, slot: Slot) -> None:
        region, copied_out = slot.where
        with torch.cuda.stream(self.in_stream):
            self.in_stream.wait_event(copied_out)
            slot.data = torch.empty(slot.nbytes, dtype=torch.uint8, device=self.device)
            slot.data.copy_(region, non_blocking=True)
            slot.pending = torch.cuda.Event()
            slot.pending.record(self.in_stream)

    def complete_load(self, slot: Slot) -> bool:
        ready = slot.pending.query()
        current = torch.cuda.current_stream(self.device)
        current.wait_event(slot.pending)
        slot.data.record_stream(current)
        return ready

    def abandon(self, slot: Slot) -> bool:
        return True  # the copy is already queued on the prefetch stream

    def load_now(self, slot: Slot) -> None:
        region, copied_out = slot.where
        torch.cuda.current_stream(self.device).wait_event(copied_out)
        slot.data = torch.empty(slot.nbytes, dtype=torch.uint8, device=self.device)
        slot.data.copy_(region, non_blocking=True)  # stream-ordered before the backward that reads it

    def capacity(self) -> int:
        return sum(c[0].numel() for c in self.chunks)

    def close(self) -> None:
        torch.cuda.synchronize(self.device)  # no copy may still read or write a chunk
        self.chunks.clear()
