"""Real gloo ranks for tests/harness/test_estimate_layouts.py: every layout of ``support.estimate_layouts``
measured on two ranks (one launch); rank 0 writes each rank's per-phase peaks, the bytes gloo's threads freed
late (``foreign_freed_bytes``) and gradient digest per system as JSON."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from harness.run import loop
from harness.run.parallel_step import measure_rank
from prefixflow.memory import storage
from prefixflow.parallel import init_distributed
from support.estimate_layouts import LAYOUTS, layout_cell
from support.inline_tier import inline_tier_methods


def main(argv: list[str]) -> int:
    out = argv[0]
    for name, method in inline_tier_methods().items():
        setattr(storage.FilePool, name, method)
    device = init_distributed("cpu")
    mine: dict[str, dict] = {}
    for name in LAYOUTS:
        peaks: dict[str, dict] = {}
        late: dict[str, float] = {}

        def runner(*args, name=name, peaks=peaks, late=late, **kwargs):
            runs, inputs = loop.run_systems(*args, **kwargs)
            for run in runs:
                if run.failure is not None:
                    raise RuntimeError(f"{name} {run.name}: {run.failure}")
                peaks[run.name] = run.memory["phase_peak_bytes"]
                late[run.name] = run.memory["foreign_freed_bytes"]
            return runs, inputs

        records = measure_rank(layout_cell(name), device, runner=runner)
        mine[name] = {
            "peaks": peaks,
            "late": late,
            "grads": {r["system"]: r["grad_sha256"] for r in records},
            "offloaded": {r["system"]: r["offloaded_bytes"] for r in records},
        }
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({name: [rank[name] for rank in every] for name in LAYOUTS}, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    raise SystemExit(main(sys.argv[1:]))
