"""A tree cell (``cell.tree`` set) in one process: its seeded workload (``harness.workloads``) as one
``prefixflow.RolloutTree``, a model copy per system (same seed), measured by the one loop
(``harness.run.loop``). One record per system: the shape's token statistics, median step time, per-level Phase-A/C
seconds (PrefixFlow's per-node times summed by the node's level, root = 0), unique and trunk tokens, peak memory
and counted FLOPs."""

from __future__ import annotations

import json
import statistics
import traceback
from typing import Any

import torch

from harness.run.columns import base_record, counted_columns, failed_records, model_columns
from harness.run.loop import SystemRun, cell_records, run_systems
from harness.run.setup import build_for, resolve_device, vocab_size_of
from harness.spec.cell import Cell

__all__ = ["run_tree_cell", "level_times", "workload_columns"]


def level_times(tree, node_times: dict[int, dict[str, float]]) -> dict[str, dict[int, float]]:
    """Per phase ("A", "C"), the seconds of the cached nodes at each level (a node's ancestors count)."""
    out: dict[str, dict[int, float]] = {}
    for j, phases in node_times.items():
        level = len(tree.ancestors(int(j)))
        for phase, s in phases.items():
            out.setdefault(phase, {})
            out[phase][level] = out[phase].get(level, 0.0) + s
    return out


def workload_columns(cell: Cell, stats: dict[str, Any]) -> dict[str, Any]:
    shape = cell.tree
    return {
        "workload": shape.kind,
        "workload_label": shape.label,
        "workload_params": shape.model_dump_json(),
        **{f"tree_{k}": v for k, v in stats.items()},
        "unique_token_ideal": stats["path_tokens"] / stats["unique_tokens"],
    }


def _median_levels(samples: list[dict[str, dict[int, float]]]) -> str | None:
    if not samples or not samples[0]:
        return None
    keys = {(p, lv) for s in samples for p, d in s.items() for lv in d}
    out: dict[str, dict[str, float]] = {}
    for phase, level in sorted(keys):
        vals = [s.get(phase, {}).get(level, 0.0) for s in samples]
        out.setdefault(phase, {})[str(level)] = statistics.median(vals)
    return json.dumps(out, sort_keys=True)


class TreeBench:
    """One tree per step (the cell's seeded workload); FLOPs counted."""

    count_flops = True

    def __init__(self, cell: Cell, device) -> None:
        self.cell, self.device = cell, device
        self.columns: dict[str, dict[str, Any]] = {}
        self.workload = None

    def fresh(self, name: str):
        contender, model = build_for(name, self.cell, self.device)
        self.columns[name] = model_columns(model, self.cell, name)
        return contender, model

    def parallelized(self, name: str, contender, model):
        return contender, model  # one rank: no layout

    def inputs(self, runs: list[SystemRun]) -> list:
        self.workload = self.cell.tree.generate(vocab_size_of(runs[0].model))
        return [self.workload.tree()]

    def prepare(self, runs: list[SystemRun], step) -> None:
        pass

    def inspect(self, run: SystemRun, last: bool) -> dict[str, Any]:
        return {}


def run_tree_cell(cell: Cell, runner=None) -> list[dict[str, Any]]:
    """Every system of ``cell`` on its tree, interleaved; never raises for a failing system. ``runner``: the
    loop (an estimate's runs the same cell on fake tensors)."""
    try:
        device = resolve_device(cell.device)
    except RuntimeError:
        return failed_records(cell, "error", traceback.format_exc())
    bench = TreeBench(cell, device)
    if runner is None:
        runs, inputs = run_systems(cell, device, bench)
    else:
        runs, inputs = runner(cell, device, bench)
    if not inputs:
        return [{**base_record(cell, str(device)), "system": r.name, "status": r.failure[0], "error": r.failure[1]}
                for r in runs]  # fmt: skip
    tree, stats = inputs[0], bench.workload.stats()
    records = []
    for run in runs:
        rec = {**base_record(cell, str(device)), "system": run.name, **bench.columns.get(run.name, {})}
        rec.update(
            workload_columns(cell, stats), tokens=stats["path_tokens"], threads=torch.get_num_threads()
        )
        rec.update(counted_columns(run.counted))
        if run.failure is not None:
            rec["status"], rec["error"] = run.failure
        else:
            st = run.stats[-1]
            levels = [
                level_times(tree, s.tree["node_times"]) if getattr(s, "tree", None) else {} for s in run.stats
            ]
            rec.update(status="ok", error=None, samples=run.samples, memory=run.memory)
            rec.update(
                loss=float(st.loss), layout_run=st.layout, n_microbatches=st.n_microbatches,
                prefix_tokens=st.prefix_tokens,
                suffix_tokens=st.suffix_tokens, trunk_tokens=st.trunk_tokens,
                level_times=_median_levels(levels),
                phase_full_s=statistics.median(s["phase_times_s"].get("full", float("nan")) for s in run.samples),
            )  # fmt: skip
        records.append(rec)
    return cell_records(cell, [records], per_rank_columns=False)
