"""The single-process exactness table of docs/trees.md: prefix trees against an independent per-path reference.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/tree_exactness.py

For llama3 and qwen3 (the tests' tiny fp64 shapes), random trees of depth 1-4 and branching 2-5, ``pg`` and
``grpo`` (old/ref log-probs, KL; token and sequence importance sampling), padded and packed, microbatch None,
1, 2, 3, AC none and full: the worst over every tensor of ``max|d| / max|ref|`` and the loss's relative
error, per family and system.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from conftest import tiny_model  # noqa: E402
from support.reference import max_rel_diff  # noqa: E402
from support.tree_reference import random_tree, reference_tree  # noqa: E402

import prefixflow as pf  # noqa: E402

GRPO = {"kl_coef": 0.05, "clip_eps_low": 0.1, "clip_eps_high": 0.15}
SHAPES = [(1, 4), (2, 3), (3, 2), (4, 2), (2, 5)]
LOSSES = [("pg", None), ("grpo", GRPO), ("grpo", {**GRPO, "importance_sampling": "sequence"})]

print("| family | system | configurations | worst gradient | worst loss |\n|---|---|---|---|---|")
for family in ("llama3", "qwen3"):
    worst = {"baseline": [0.0, 0.0, 0], "prefixflow": [0.0, 0.0, 0]}
    for ac in ("none", "full"):
        model = tiny_model(family, ac=ac)
        for depth, branching in SHAPES if ac == "none" else SHAPES[1:3]:
            for loss, cfg in LOSSES:
                tree = random_tree(depth * 10 + branching, depth, branching, grpo=loss == "grpo")
                want_loss, want = reference_tree(model, tree, loss, cfg)
                for system in worst:
                    for layout in ("padded", "packed"):
                        for microbatch in (None, 1, 2, 3):
                            model.zero_grad(set_to_none=True)
                            stats = pf.train_group(
                                model, tree, system=system, layout=layout, microbatch=microbatch, loss=loss,
                                loss_config=cfg,
                            )  # fmt: skip
                            got = [p.grad for p in model.parameters()]
                            entry = worst[system]
                            entry[0] = max(entry[0], max_rel_diff(got, want))
                            entry[1] = max(entry[1], abs(stats.loss - want_loss) / abs(want_loss))
                            entry[2] += 1
    for system, (grad, loss_err, n) in worst.items():
        print(f"| {family} | {system} | {n} | {grad:.1e} | {loss_err:.1e} |")
