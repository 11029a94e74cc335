"""A parallel layout estimated in one process: each chosen rank on torch's fake process group.

- **The fake world.** ``FakeStore`` with backend ``"fake"`` makes this process rank ``r`` of a world of
  ``cell.world_size`` ranks; the device mesh is built from it, outside the fake mode. Its collectives move
  nothing: each returns the local rank's data (``all_reduce`` does not sum, ``all_gather_object`` repeats this
  rank's object). The library plans nothing from gathered values (CP's prefix groups come from the mesh), so a
  rank's schedule, shapes and lifetimes are its real ones.
- **Which ranks.** Ranks that differ only by their TP or EP coordinate hold shards of one shape (the layout
  divides heads, features and experts evenly; FSDP2 pads its shards to one size) and train the same tokens, so
  one rank stands for them. Every PP stage and every CP shard (head–tail shards hold different loss positions)
  runs; the data-parallel ranks collapse only when the step's groups all have one shape and divide evenly.
  ``tests/harness/test_estimate_layouts.py`` runs every rank of TP2×CP2×PP2 and checks the chosen ones give the
  same maxima.
- **Rank-max** is the maximum over the chosen ranks of each phase's peak, as a measured cell's.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from harness.estimate.loop import estimate_systems
from harness.run.loop import cell_records
from harness.run.parallel_step import measure_rank
from harness.run.setup import make_group
from harness.spec.cell import Cell
from prefixflow.parallel.mesh import DENSE_ORDER

__all__ = [
    "fake_world",
    "chosen_ranks",
    "representatives",
    "rank_coordinates",
    "estimate_ranks",
    "estimate_layout",
]


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """This process as ``rank`` of a fake process group of ``world_size`` ranks (torch's ``FakeStore``)."""
    if dist.is_initialized():
        raise RuntimeError("an estimate of a layout needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _forget_meshes() -> None:
    """Clear DTensor's caches keyed by device mesh. A mesh compares equal to the previous rank's (same layout,
    same names), so a cached sharding or redistribution plan would name that rank's destroyed groups."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # the Python cache and the C++ fast path's
    DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()
    clear_redistribute_planner_cache()


def rank_coordinates(cell: Cell) -> list[dict[str, int]]:
    """Every rank's coordinates in the dense mesh ``(pp, dp_replicate, dp_shard, cp, tp)``, by rank."""
    shape = tuple(getattr(cell.parallel, name) for name in DENSE_ORDER)
    axes = [c.tolist() for c in torch.unravel_index(torch.arange(cell.world_size), shape)]  # row-major, as the mesh
    return [dict(zip(DENSE_ORDER, coords, strict=True)) for coords in zip(*axes, strict=True)]


def _uniform_batch(cell: Cell) -> bool:
    """Whether every data-parallel rank trains groups of the same shapes: the step's groups all have one shape
    and divide evenly over the batch ranks (else the placement, by cost, may give ranks different work)."""
    batch = cell.parallel.dp_replicate * cell.parallel.dp_shard
    if cell.groups_per_step % batch:
        return False
    shapes = set()
    for i in range(cell.groups_per_step):
        group = make_group(cell, 2, i)  # lengths only: the vocabulary does not change them
        shapes.add((int(group.prompt.numel()), tuple(int(r.numel()) for r in group.responses)))
    return len(shapes) == 1


def representatives(cell: Cell) -> list[int]:
    """For every rank, the rank that stands for it: the lowest rank of the same (PP stage, CP shard,
    data-parallel work)."""
    uniform = _uniform_batch(cell)
    seen: dict[tuple, int] = {}
    out = []
    for rank, c in enumerate(rank_coordinates(cell)):
        batch = 0 if uniform else (c["dp_replicate"], c["dp_shard"])
        out.append(seen.setdefault((c["pp"], c["cp"], batch), rank))
    return out


def chosen_ranks(cell: Cell) -> list[int]:
    """The ranks an estimate of ``cell`` runs: one per distinct (PP stage, CP shard, data-parallel work)."""
    return sorted(set(representatives(cell)))


def estimate_ranks(cell: Cell, ranks: list[int]) -> list[list[dict[str, Any]]]:
    """Each of ``ranks``' records of ``cell`` (per system, with its metered step's ``memory``), each rank on
    the fake process group in turn."""
    device = torch.device("cpu")
    per_rank = []
    for rank in ranks:
        with fake_world(cell.world_size, rank):
            per_rank.append(measure_rank(cell, device, runner=estimate_systems))
    return per_rank


def estimate_layout(cell: Cell, ranks: list[int] | None = None) -> list[dict[str, Any]]:
    """``cell``'s records from its ``ranks`` (default :func:`chosen_ranks`), each on the fake process group,
    merged as a measured cell's ranks are (rank-max memory); the ``estimate_ranks`` column names the ranks."""
    ranks = chosen_ranks(cell) if ranks is None else ranks
    per_rank = estimate_ranks(cell, ranks)
    seconds = [0.0 for _ in per_rank[0]]
    for rows in per_rank:
        for i, rec in enumerate(rows):
            seconds[i] += (rec.get("memory") or {}).get("estimate_s") or 0.0
    records = cell_records(cell, per_rank, per_rank_columns=True)  # rank-max memory, every phase
    for rec, spent in zip(records, seconds, strict=True):
        rec["estimate_ranks"] = json.dumps(ranks)
        rec["estimate_s"] = spent  # every chosen rank's metered step, one after another
        rec.pop("threads", None)
    return records
