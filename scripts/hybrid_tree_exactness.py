"""Prefix trees on hybrid HF models with transformers' stock kernels (fp64, fp32 casts not patched): the worst
loss and gradient error of PrefixFlow against the baseline on the same tree.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/hybrid_tree_exactness.py
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import torch  # noqa: E402
from support.hybrid import nemotron_h, qwen3_5  # noqa: E402
from support.reference import max_rel_diff  # noqa: E402
from support.tree_reference import random_tree  # noqa: E402

import prefixflow as pf  # noqa: E402
from prefixflow.integrations import hf  # noqa: E402,F401  (registers the HF adapter)

MODELS = {
    "qwen3_5 [lin, full, lin]": lambda: qwen3_5(("linear_attention", "full_attention", "linear_attention")),
    "nemotron_h [mamba, attn, mlp]": lambda: nemotron_h(("mamba", "attention", "mlp")),
}
print("| model | worst gradient | worst loss |\n|---|---|---|")
for name, make in MODELS.items():
    model = pf.apply_prefixflow(make())
    tree = random_tree(13, 3, 3, min_shared_tokens=2)

    def run(model=model, tree=tree, **kwargs):
        model.zero_grad(set_to_none=True)
        loss = pf.train_group(model, tree, **kwargs).loss
        return loss, [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]

    want_loss, want = run(system="baseline", layout="padded")
    worst = [0.0, 0.0]
    for layout in ("padded", "packed"):
        for microbatch in (None, 1, 2):
            loss, got = run(layout=layout, microbatch=microbatch)
            worst = [
                max(worst[0], max_rel_diff(got, want)),
                max(worst[1], abs(loss - want_loss) / abs(want_loss)),
            ]
    print(f"| {name} | {worst[0]:.1e} | {worst[1]:.1e} |")
