"""One measurement loop (issue 31): every measured cell kind (one group, a tree, the data-parallel step) runs
through ``harness.run.loop.run_systems``; no other module that measures cells (``harness/run``, ``harness/rl``,
``harness/execute``) meters a step or repeats one. (``harness/peers/timing.py`` and ``node_cost.py`` are
stand-alone scripts outside pf-bench's cells, with their own documented loops.)"""

from __future__ import annotations

import ast
from pathlib import Path

HARNESS = Path(__file__).resolve().parents[2] / "harness"
KINDS = ("single_group.py", "tree_cell.py", "parallel_step.py")


def _meter_sites(source: str) -> int:
    """Calls of ``PhaseMeter(...)`` and ``for`` loops over ``range(... warmup ...)`` in ``source``."""
    sites = 0
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", "")) == "PhaseMeter"
        ):
            sites += 1
        if isinstance(node, ast.For) and "warmup" in ast.unparse(node.iter):
            sites += 1
    return sites


def test_only_the_loop_meters_and_repeats_steps():
    files = [p for d in ("run", "rl", "execute") for p in (HARNESS / d).rglob("*.py")]
    sites = {p.relative_to(HARNESS).as_posix(): _meter_sites(p.read_text()) for p in files}
    assert {p for p, n in sites.items() if n} == {"run/loop.py"}, sites
    for kind in KINDS:  # each cell kind hands its Bench to the loop
        assert "run_systems(" in (HARNESS / "run" / kind).read_text(), kind


def test_the_check_sees_a_second_loop():
    injected = "for it in range(cell.warmup + cell.repeats):\n    meter = PhaseMeter(device)\n"
    assert _meter_sites(injected) == 2


def test_ranks_merge_to_the_largest_peak_of_each_phase():
    """``merge_ranks`` takes each phase's peak over ranks on its own: the step's largest phase differs by rank."""
    from harness.run.loop import merge_ranks

    def rank(a: float, b: float, c: float) -> list[dict]:
        memory = {"mem_meter": "live-bytes", "peak_mem_bytes": max(a, b, c), "peak_mem_phase_b_bytes": b,
                  "phase_peak_bytes": {"A": a, "B": b, "C": c}}  # fmt: skip
        sample = {"step_time_s": 1.0, "phase_a_s": 0.1, "phase_b_s": 0.8, "phase_c_s": 0.1}
        return [{"system": "prefixflow", "status": "ok", "samples": [sample], "memory": memory}]

    (rec,) = merge_ranks([rank(10.0, 3.0, 4.0), rank(2.0, 7.0, 9.0)])
    assert (rec["peak_mem_phase_a_bytes"], rec["peak_mem_phase_b_bytes"], rec["peak_mem_phase_c_bytes"]) == (10, 7, 9)
    assert rec["peak_mem_bytes"] == 10 and rec["mem_meter"] == "live-bytes"
