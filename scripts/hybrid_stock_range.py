"""Measure the range of docs/hybrid.md's stock fp64 agreement with HF over many configurations, not one.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python scripts/hybrid_stock_range.py [--seeds 4] [--groups 3]

For each hybrid model of ``scripts/hybrid_equivalence.py`` (the tests' shapes), each model seed, and each
random group (prompt 5..20 tokens, 4 responses of 1..12 tokens, seeded), PrefixFlow's stock fp64 gradients
against the stock full-sequence HF reference: the largest max|d|/max|ref| over the parameters and over
padded/packed x microbatch None/1/2. Prints, per model, the min / median / max over the configurations and the
tensor of the max; then the range over every configuration.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hybrid_equivalence import MODELS  # noqa: E402
from support import hybrid as H  # noqa: E402

import prefixflow as pf  # noqa: E402

RUNS = [(layout, mb) for layout in ("padded", "packed") for mb in (None, 1, 2)]


def _group(seed: int) -> pf.RolloutGroup:
    gen = torch.Generator().manual_seed(1000 + seed)
    prompt = int(torch.randint(5, 21, (1,), generator=gen))
    lens = torch.randint(1, 13, (4,), generator=gen).tolist()
    return pf.synthetic_group(H.VOCAB, prompt, lens, seed=seed)


def worst(family, types, seed: int, group) -> tuple[float, str]:
    model = family(types, seed=seed) if seed else family(types)
    _, ref = H.reference_pg(model, group)
    pf.apply_prefixflow(model)
    out = (0.0, "")
    for layout, microbatch in RUNS:
        model.zero_grad(set_to_none=True)
        pf.train_group(model, group, layout=layout, microbatch=microbatch)
        out = max(out, H.worst_grad(model, ref))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=4, help="model seeds 0..seeds-1")
    parser.add_argument("--groups", type=int, default=3, help="random groups per model seed")
    args = parser.parse_args()
    print("| model | configurations | min | median | max (tensor) |")
    print("| --- | --- | --- | --- | --- |")
    everything = []
    for label, (family, types) in MODELS.items():
        if label.startswith("bamba"):  # its builder takes no seed: one model, several groups
            seeds = [0]
        else:
            seeds = list(range(args.seeds))
        values = [worst(family, types, s, _group(g)) for s in seeds for g in range(args.groups)]
        errors = [v for v, _ in values]
        top = max(values)
        everything += errors
        print(
            f"| {label} | {len(errors)} | {min(errors):.1e} | {statistics.median(errors):.1e} | "
            f"{top[0]:.1e} (`{top[1]}`) |"
        )
    print(f"\nall {len(everything)} configurations: {min(everything):.1e} .. {max(everything):.1e}")


if __name__ == "__main__":
    main()
