"""A tree cell (``cell.tree`` set) in one process: its seeded workload (``harness.workloads``) as one
``prefixflow.RolloutTree``, a model copy per system (same seed), warm-up, repeats visiting the systems in
alternating order (A B C, C B A, ...), then one untimed step per system on CPU under the live-bytes meter and
the FLOP counters. One record per system: the shape's token statistics, median step time, per-level Phase-A/C
seconds (PrefixFlow's per-node times summed by the node's level, root = 0), unique and trunk tokens, peak memory
and counted FLOPs."""

from __future__ import annotations

import gc
import json
import statistics
import traceback
from typing import Any

import torch

from harness.run.columns import (
    base_record,
    classify,
    counted_columns,
    failed_records,
    memory_columns,
    model_columns,
    step_time_columns,
)
from harness.run.measure import PhaseMeter
from harness.run.progress import report
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


def run_tree_cell(cell: Cell) -> list[dict[str, Any]]:
    """Every system of ``cell`` on its tree, interleaved; never raises for a failing system."""
    try:
        device = resolve_device(cell.device)
    except RuntimeError:
        return failed_records(cell, "error", traceback.format_exc())
    contenders, models, failures, extras = {}, {}, {}, {}
    for name in cell.systems:
        report(f"building {name} ({cell.model.display}, {cell.dtype}, {device})")
        try:
            contenders[name], models[name] = build_for(name, cell, device)
            extras[name] = model_columns(models[name], cell, name)
        except Exception as e:
            failures[name] = (classify(e), traceback.format_exc())
    if not models:
        return [{**base_record(cell, str(device)), "system": n, "status": f[0], "error": f[1]}
                for n, f in failures.items()]  # fmt: skip
    workload = cell.tree.generate(vocab_size_of(next(iter(models.values()))))
    tree = workload.tree()
    stats = workload.stats()
    samples = {n: [] for n in cell.systems}
    levels = {n: [] for n in cell.systems}
    last, counted, memory = {}, {}, {}

    def step(name: str, track_memory: bool, count: bool = False):
        from harness.costmodel.flops import count_flops

        model = models[name]
        try:
            model.zero_grad(set_to_none=True)
            meter = PhaseMeter(device, model=model, track_memory=track_memory)
            with meter:
                run = lambda: contenders[name].step(model, [tree], cell, meter)  # noqa: E731
                if count:
                    counted[name], st = count_flops(run)
                else:
                    st = run()
            model.zero_grad(set_to_none=True)
            return meter.results(extended=True), st
        except Exception as e:
            failures[name] = (classify(e), traceback.format_exc())
            models[name] = None
            gc.collect()
            return None

    live = [n for n in cell.systems if n not in failures]
    for it in range(cell.warmup + cell.repeats):
        for name in live if it % 2 == 0 else live[::-1]:
            if name in failures:
                continue
            report(f"{'warm-up' if it < cell.warmup else 'repeat'} {it + 1} {name}")
            if (out := step(name, track_memory=False)) is None:
                continue
            if it >= cell.warmup:
                samples[name].append(out[0])
                last[name] = out[1]
                info = getattr(out[1], "tree", None)
                levels[name].append(level_times(tree, info["node_times"]) if info else {})
    if device.type == "cpu" and not cell.compile:
        for name in live:
            if name not in failures and (out := step(name, True, count=True)) is not None:
                memory[name] = out[0]
    records = []
    for name in cell.systems:
        rec = {**base_record(cell, str(device)), "system": name, **extras.get(name, {})}
        rec.update(
            workload_columns(cell, stats), tokens=stats["path_tokens"], threads=torch.get_num_threads()
        )
        rec.update(counted_columns(counted.get(name)))
        if name in failures:
            rec["status"], rec["error"] = failures[name]
        else:
            st = last[name]
            rec.update(status="ok", error=None, **step_time_columns(samples[name]))
            rec.update(memory_columns(memory.get(name), samples[name], cell))
            rec.update(
                loss=float(st.loss), layout_run=st.layout, n_microbatches=st.n_microbatches,
                prefix_tokens=st.prefix_tokens,
                suffix_tokens=st.suffix_tokens, trunk_tokens=st.trunk_tokens,
                level_times=_median_levels(levels[name]),
                phase_full_s=statistics.median(s["phase_times_s"].get("full", float("nan")) for s in samples[name]),
            )  # fmt: skip
        records.append(rec)
    return records
