"""The Claim-2 loop on many ranks: what its processes share, and how they are started.

One process (``Ranks.single()``) or every rank of a ``torch.distributed`` job (``Ranks.joined(spec)``) runs the
same :func:`harness.rl.run.run_claim2`. On many ranks:

- **models**: each actor (and the frozen reference) is parallelized over the spec's layout in TorchTitan's
  order (``prefixflow.parallel.parallelize``, one device mesh for all of them); the rollout model is a full
  replica on every rank, as a colocated inference engine holds its own copy, filled by ``sync_weights``;
- **generation**: prompt ``i`` of a step is sampled on rank ``i mod world`` (its noise is seeded by the
  prompt, so the rollouts are the ones one process samples) and every rank receives all of them;
- **times**: each phase's time is the slowest rank's (the ranks meet at the phase's collectives);
- **files**: rank 0 alone writes (``harness.rl.io``); every rank calls the gathers that precede a write.

Starting the ranks: ``harness.rl.launch``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Ranks", "LOOP_DIMS", "check_loop_layout"]

# The mesh dimensions the loop's actor runs on (the trainer pieces are tested on them: tests/prefixflow/rl/test_rl_parallel.py).
LOOP_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")


def check_loop_layout(parallel: dict[str, int]) -> None:
    """Raise ``ValueError`` naming the field if the layout uses a dimension the closed loop does not run."""
    other = [f"{k}={v}" for k, v in parallel.items() if v > 1 and k not in LOOP_DIMS]
    if other:
        raise ValueError(
            f"parallel: the closed loop's actor runs on {', '.join(LOOP_DIMS)}; {', '.join(other)} is not "
            f"supported in the loop (set those degrees to 1)"
        )


@dataclass
class Ranks:
    """This process's place among the loop's processes, and what they do together."""

    rank: int = 0
    world: int = 1
    dims: dict[str, int] | None = None
    mesh: Any = None

    @classmethod
    def single(cls) -> Ranks:
        return cls()

    @classmethod
    def joined(cls, parallel: dict[str, int], device: torch.device) -> Ranks:
        """Every rank of the running process group, laid out as ``parallel`` (the spec's degrees)."""
        from prefixflow.parallel import ParallelDims, build_mesh

        dims = ParallelDims.of(parallel)
        if dist.get_world_size() != dims.world_size:
            raise ValueError(
                f"parallel layout {dims.label} needs {dims.world_size} ranks; this job has {dist.get_world_size()}"
            )
        return cls(dist.get_rank(), dims.world_size, dims.as_dict(), build_mesh(dims, device))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def parallelize(self, model: nn.Module) -> nn.Module:
        """``model`` parallelized over the loop's layout (on one process: unchanged)."""
        if self.world == 1:
            return model
        from prefixflow.parallel import parallelize

        return parallelize(model, self.dims, mesh=self.mesh)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def from_main(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (small, picklable objects: records, numbers)."""
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def share(self, make: Callable[[int], Any], count: int) -> list[Any]:
        """``[make(0), ..., make(count - 1)]`` on every rank, item ``i`` computed on rank ``i mod world``.
        Tensors in the items travel on the CPU and come back on their device."""
        if self.world == 1:
            return [make(i) for i in range(count)]
        mine = {i: _to(make(i), "cpu") for i in range(self.rank, count, self.world)}
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, mine)
        merged = {i: item for part in parts for i, item in part.items()}
        device = self.mesh.device_type
        return [_to(merged[i], device) for i in range(count)]

    def slowest(self, times: dict[str, float]) -> dict[str, float]:
        """Each time the maximum over ranks (NaN only where every rank has NaN)."""
        from harness.run.measure import rank_max

        return rank_max(times) if self.world > 1 else dict(times)


def _to(obj: Any, device: str | torch.device) -> Any:
    """``obj`` with every tensor (in lists, tuples, dicts and dataclasses) moved to ``device``."""
    import dataclasses

    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, list | tuple):
        return type(obj)(_to(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: _to(getattr(obj, f.name), device) for f in dataclasses.fields(obj)}
        )
    return obj
