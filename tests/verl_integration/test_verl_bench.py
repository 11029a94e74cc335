"""pf-bench's verl contenders (``verl``: verl's own FSDP engine; ``verl_prefixflow``: PrefixFlow's engine for verl)
in the single-group cell loop: both record ``ok`` and report the same verl loss on the cell's group, PrefixFlow
embedding the prompt once (its counted FLOPs well below verl's). Tiny Qwen3, remove-padding, no warm-up, one repeat."""

from __future__ import annotations

import pytest

pytest.importorskip("verl", minversion="0.9")

import verl_cpu  # noqa: E402, F401  (selects the CPU platform before verl's engines import)


def test_verl_contenders_record_the_same_update():
    from harness.run.single_group import run_single_group_cell
    from harness.spec.cell import Cell, ModelSpec

    cell = Cell(
        spec="adhoc",
        model=ModelSpec(name="hf:qwen3-tiny"),
        prefix_len=24,
        suffix_len=8,
        n=4,
        layout="packed",
        systems=("verl", "verl_prefixflow"),
        device="cpu",
        warmup=0,
        repeats=1,
    )
    records = {r["system"]: r for r in run_single_group_cell(cell)}
    assert {s: r["status"] for s, r in records.items()} == {"verl": "ok", "verl_prefixflow": "ok"}, records
    verl, ours = records["verl"], records["verl_prefixflow"]
    assert ours["loss"] == pytest.approx(verl["loss"], rel=1e-5)
    assert (verl["prefix_tokens"], ours["prefix_tokens"]) == (4 * 24, 24)
    assert verl["step_time_s"] > 0 and ours["step_time_s"] > 0
    assert ours["counted_flops"] < 0.6 * verl["counted_flops"]  # measured: PrefixFlow's engine really ran
