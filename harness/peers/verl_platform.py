"""A CPU platform for verl 0.9.x, registered through verl's own plugin registry (no verl file is patched).

verl assumes an accelerator: ``get_device_name()`` is ``'cuda'`` and its FSDP engine registers for cuda/npu only.
:func:`select_cpu_platform` registers :class:`CPUPlatform` under ``VERL_PLATFORM`` and sets
``VERL_ENGINE_DEVICE=cuda`` (the engine registry then hands out the engine registered for cuda). Call it before
anything imports verl's engines: verl reads the device name at import.
"""

from __future__ import annotations

import contextlib
import os
from types import ModuleType

import torch

__all__ = ["PLATFORM", "select_cpu_platform"]

PLATFORM = "prefixflow_cpu"


def init_one_rank() -> None:
    """A one-process gloo group on loopback (verl's FSDP engines need a process group)."""
    import socket

    if torch.distributed.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def select_cpu_platform() -> None:
    """Select the CPU platform for verl in this process (idempotent)."""
    os.environ.setdefault("VERL_PLATFORM", PLATFORM)
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
    _register()


_registered = False


class _CPUDeviceModule(ModuleType):
    """``torch.cpu`` with the RNG-state calls verl's checkpoint manager makes of a device module (the CPU
    generator's: ``torch.get_rng_state`` / ``torch.set_rng_state``) and zeros for the memory counters verl logs
    (it skips them only for ``torch.cpu`` itself), a no-op ``empty_cache``; everything else is ``torch.cpu``'s."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def get_rng_state(device=None):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, device=None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def memory_allocated(device=None) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def mem_get_info(device=None) -> tuple[int, int]:
        return 0, 0

    @staticmethod
    def empty_cache() -> None:  # HFRollout frees the cache after generating; a CPU has none
        return None


def _cpu_device_module() -> ModuleType:
    return _CPUDeviceModule("prefixflow_verl_cpu")


_CPU_MODULE = _cpu_device_module()


def _register() -> None:
    global _registered
    if _registered:
        return
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    @PlatformRegistry.register(platform=PLATFORM)
    class CPUPlatform(PlatformBase):
        """Just enough of an accelerator for verl's FSDP engine on one CPU process."""

        device_name = "cpu"
        vendor_name = "cpu"

        @property
        def device_module(self) -> ModuleType:
            return _CPU_MODULE

        def is_available(self) -> bool:
            return True

        def current_device(self):
            return "cpu"  # verl moves micro-batches with .to(get_device_id())

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index) -> None:
            return None

        def synchronize(self, device_index=None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0):
            return (None, None)

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "GPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self):
            return None

    _registered = True
