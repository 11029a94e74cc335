"""The layouts ``tests/harness/test_estimate_layouts.py`` estimates and measures (one definition for both sides)."""

from __future__ import annotations

from harness.spec.cell import Cell, ModelSpec

TINY = ModelSpec(
    name="llama3:debugmodel",
    overrides={"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512},
)
# name -> (parallel layout, ac, offload); each runs the baseline and PrefixFlow
LAYOUTS = {
    "tp2": ({"tp": 2}, "none", False),
    "tp2-offload": ({"tp": 2}, "none", True),
    "tp2-selective": ({"tp": 2}, "selective", False),
    "tp2-selective-offload": ({"tp": 2}, "selective", True),
    "cp2-selective": ({"cp": 2}, "selective", False),
    "cp2-selective-offload": ({"cp": 2}, "selective", True),
    "fsdp2": ({"dp_shard": 2}, "none", False),
    "pp2": ({"pp": 2}, "none", False),
}


def layout_cell(name: str) -> Cell:
    parallel, ac, offload = LAYOUTS[name]
    return Cell(spec="estimate-layouts", model=TINY, prefix_len=96, suffix_len=24, n=3, dtype="fp64",
                microbatch=1, parallel=parallel, ac=ac, offload=offload, systems=("baseline", "prefixflow"),
                warmup=0, repeats=1, device="cpu")  # fmt: skip
