"""Check the hybrid cost model against what runs, on every combination the test samples.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python scripts/hybrid_flops_check.py

For Qwen3.5 (gated DeltaNet) and Nemotron-H (Mamba-2) models of several layer mixes and groups (prompts of 1, 2,
13, 20, 60 and 66 tokens; one-token responses; rows crossing the kernels' chunks), every system x layout x
microbatch (None, 1, 2) x PrefixFlow attention variant: ``harness.costmodel.hybrid.hybrid_ops`` against
``harness.costmodel.counting.count_ops`` (FlopCounterMode's mm/bmm, the SDPA pairs, convolutions and triangular
solves), op by op. Prints every mismatch and the number of runs checked.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support import hybrid as H  # noqa: E402

import prefixflow as pf  # noqa: E402
from harness.costmodel.counting import count_ops  # noqa: E402
from harness.costmodel.flops import as_shape  # noqa: E402
from harness.costmodel.hybrid import hybrid_ops  # noqa: E402

LIN, FULL = "linear_attention", "full_attention"
CASES = [
    (H.qwen3_5, (LIN, FULL, LIN), [(13, [5, 9, 1, 7]), (1, [3, 2]), (2, [4, 1, 3]), (60, [5, 70, 1])]),
    (H.qwen3_5, (FULL, LIN), [(13, [5, 9, 1, 7])]),
    (H.qwen3_5, (LIN, LIN), [(13, [5, 9, 1, 7]), (66, [1, 1])]),
    (H.nemotron_h, (LIN, FULL, "mlp"), [(13, [5, 9, 1, 7])]),
    (H.nemotron_h, ("mlp", LIN, FULL), [(2, [4, 1]), (20, [17, 1, 3])]),
    (H.nemotron_h, (FULL, LIN), [(13, [5, 9, 1, 7])]),
]
RUNS = [("baseline", layout, mb, "split") for layout in ("padded", "packed") for mb in (None, 1, 2)] + [
    ("prefixflow", layout, mb, attention)
    for layout in ("padded", "packed")
    for mb in (None, 1, 2)
    for attention in ("split", "concat")
]


def main() -> None:
    checked = bad = 0
    for family, types, groups in CASES:
        model = family(types, dtype=torch.float32)
        shape = as_shape(model.config)
        for P, lens in groups:
            group = pf.synthetic_group(H.VOCAB, P, lens, seed=3)
            for system, layout, mb, attention in RUNS:
                pf.apply_prefixflow(model, pf.PrefixFlowConfig(attention=attention))
                got, _ = count_ops(
                    lambda mo=model, g=group, s=system, la=layout, m=mb: pf.train_group(
                        mo, g, system=s, layout=la, microbatch=m
                    )
                )
                want = hybrid_ops(system, shape, P, lens, layout=layout, microbatch=mb, attention=attention)
                checked += 1
                if got != want:
                    bad += 1
                    print(
                        "MISMATCH", family.__name__, types, P, lens, system, layout, mb, attention, want, got
                    )
    print(f"{checked} runs checked, {bad} mismatches")


if __name__ == "__main__":
    main()
