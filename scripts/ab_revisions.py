"""Speed and Phase-B memory of one library revision against another, side by side in one run.

Two worker processes (one per source tree, one thread each) build the same cell; the driver asks them in turn
for one timed step of each system, ``--pairs`` warm interleaved pairs after a warm-up, and then for one
step under the live-bytes meter (Phase-B peak). It prints the medians, their spread ((max - min) / median) and
the ratios ``t_before / t_after`` and ``peak_after / peak_before`` per cell and system.

    git worktree add /tmp/before <rev>
    OMP_NUM_THREADS=1 .venv/bin/python scripts/ab_revisions.py --before /tmp/before --after . --pairs 7

Cells (issue 31's three): ``claim3`` (experiments/claim3.yaml: llama3 debugmodel, P=640, S=128, N=16,
microbatch 1, padded), ``trees`` (experiments/trees.yaml's 27-path agentic tree, dim 128, 2 layers, padded,
microbatch 1), ``hybrid`` (experiments/hybrid.yaml: HF Qwen3.5 tiny, P=320, S=64, N=16, packed, microbatch 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import revision_worker  # scripts/, beside this file

CELLS = ("claim3", "trees", "hybrid")
SYSTEMS = ("baseline", "prefixflow")


def _build(cell: str):
    """(model, input, train_group kwargs) of ``cell``, with this process's revision of the library."""
    import torch

    import prefixflow as pf

    torch.manual_seed(0)
    if cell == "claim3":
        model = pf.apply_prefixflow(pf.build_model("llama3:debugmodel", dtype=torch.float32, seed=0))
        group = pf.synthetic_group(2048, 640, [128] * 16, seed=0)
        return model, group, dict(layout="padded", microbatch=1)
    if cell == "trees":
        from harness.workloads import AgenticShape

        overrides = {"dim": 128, "n_layers": 2, "n_heads": 4, "vocab_size": 512, "max_seq_len": 2048}
        model = pf.apply_prefixflow(
            pf.build_model("llama3:debugmodel", dtype=torch.float32, seed=0, overrides=overrides)
        )
        shape = AgenticShape(system_len=256, turns=3, assistant_len=32, reply_len=96, branch=3)
        return model, shape.generate(512).tree(), dict(layout="padded", microbatch=1)
    if cell == "hybrid":
        from prefixflow.integrations import hf

        model = pf.apply_prefixflow(hf.build_hf_model("qwen3_5-tiny", dtype=torch.float32))
        vocab = hf.hf_config("qwen3_5-tiny").vocab_size
        return model, pf.synthetic_group(vocab, 320, [64] * 16, seed=0), dict(layout="packed", microbatch=1)
    raise ValueError(f"cell {cell!r} unknown; valid: {CELLS}")


class _PhaseB:
    """Observer: the live-bytes meter's peak during Phase B (the baseline's one phase)."""

    def __init__(self, meter) -> None:
        self.meter, self.peak = meter, 0

    def enter(self, phase: str) -> None:
        if phase in ("B", "full"):
            self.meter.reset_peak()

    def exit(self, phase: str) -> None:
        if phase in ("B", "full"):
            self.peak = max(self.peak, self.meter.peak)


def worker(cell: str) -> None:
    import torch
    from prefixflow.live_bytes import LiveBytesMeter

    import prefixflow as pf

    torch.set_num_threads(1)
    model, group, kwargs = _build(cell)
    print(json.dumps({"ready": pf.__file__}), flush=True)
    for line in sys.stdin:
        system, what = line.split()
        model.zero_grad(set_to_none=True)
        if what == "time":
            start = time.perf_counter()
            pf.train_group(model, group, system=system, **kwargs)
            out = {"s": time.perf_counter() - start}
        else:
            meter = LiveBytesMeter("cpu")
            meter.register(model)
            probe = _PhaseB(meter)
            with meter:
                pf.train_group(model, group, system=system, observer=probe, **kwargs)
            out = {"peak_b": probe.peak}
        print(json.dumps(out), flush=True)


def _start(root: str, cell: str) -> subprocess.Popen:
    proc = revision_worker.start(
        root, __file__, cell, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    ready = json.loads(proc.stdout.readline())
    if not ready["ready"].startswith(os.path.abspath(root)):
        raise RuntimeError(f"the worker for {root} imported prefixflow from {ready['ready']}")
    return proc


def _ask(proc: subprocess.Popen, system: str, what: str) -> dict:
    proc.stdin.write(f"{system} {what}\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def compare(before: str, after: str, cells, pairs: int) -> list[dict]:
    rows = []
    for cell in cells:
        procs = {"before": _start(before, cell), "after": _start(after, cell)}
        times = {(rev, s): [] for rev in procs for s in SYSTEMS}
        for rep in range(pairs + 1):  # the first round warms up
            order = list(procs) if rep % 2 == 0 else list(procs)[::-1]
            for system in SYSTEMS:
                for rev in order:
                    t = _ask(procs[rev], system, "time")["s"]
                    if rep:
                        times[rev, system].append(t)
        for system in SYSTEMS:
            peaks = {rev: _ask(procs[rev], system, "mem")["peak_b"] for rev in procs}
            med = {rev: statistics.median(times[rev, system]) for rev in procs}
            spread = {rev: (max(times[rev, system]) - min(times[rev, system])) / med[rev] for rev in procs}
            rows.append(dict(
                cell=cell, system=system, t_before=med["before"], t_after=med["after"],
                speed_ratio=med["before"] / med["after"], spread_before=spread["before"],
                spread_after=spread["after"], peak_b_before=peaks["before"], peak_b_after=peaks["after"],
                peak_ratio=peaks["after"] / peaks["before"], pairs=pairs,
            ))  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
        for proc in procs.values():
            proc.stdin.close()
            proc.wait()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--before")
    parser.add_argument("--after", default=".")
    parser.add_argument("--cells", default=",".join(CELLS))
    parser.add_argument("--pairs", type=int, default=7)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    rows = compare(args.before, args.after, args.cells.split(","), args.pairs)
    for r in rows:
        print(
            f"{r['cell']:>7} {r['system']:>10}: t_before/t_after {r['speed_ratio']:.3f} "
            f"(spread {r['spread_before']:.1%} / {r['spread_after']:.1%}), Phase-B peak after/before "
            f"{r['peak_ratio']:.4f} ({r['peak_b_before'] / 2**20:.2f} -> {r['peak_b_after'] / 2**20:.2f} MiB)"
        )


if __name__ == "__main__":
    main()
