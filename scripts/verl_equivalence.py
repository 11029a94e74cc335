"""verl 0.9.1's FSDP engine vs PrefixFlow's: one train_batch each on the same DataProto (the tests' shapes and seeds).

    .venv-verl/bin/python scripts/verl_equivalence.py      (after make test-verl; CPU, fp32, one gloo rank)

Prints, per setting, the gradient difference (over all parameters; worst parameter tensor by norm and by max),
verl's loss and PrefixFlow's, and verl's dual-clip metric (pg_clipfrac_lower: the share of tokens it binds on);
then bf16 parameters against verl's bf16 engine and fp32 by the paper's τ rule.
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "verl_integration"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # harness.peers.verl_platform
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import verl_cpu as vc  # noqa: E402

MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")


def main() -> None:
    folder = tempfile.mkdtemp(prefix="pf-verl-")
    vc.save_tiny_model(folder, "qwen3")
    proto = vc.grpo_batch()
    split = vc.grpo_batch(uids=("a", "b", "c"), seed=2)[np.array([0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11])]
    cases = [(m, vc.actor_config(loss_agg_mode=m), proto, {}) for m in MODES]
    for kl in ("low_var_kl", "kl", "abs", "mse"):
        actor = vc.actor_config(
            loss_agg_mode="seq-mean-token-mean", use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type=kl
        )
        cases.append(
            (f"seq-mean-token-mean + {kl} (T=0.7)", actor, vc.grpo_batch(seed=1, temperature=0.7), {})
        )
    actor = vc.actor_config(loss_agg_mode="seq-mean-token-mean", use_kl_loss=True, kl_loss_coef=0.1)
    cases.append(
        (
            "3 uids interleaved, micro-batches of 3",
            actor,
            split,
            dict(micro_batch_size=3, global_batch_size=12),
        )
    )
    cases.append(
        (
            "gradient checkpointing",
            vc.actor_config(loss_agg_mode="token-mean"),
            proto,
            dict(checkpointing=True),
        )
    )
    kl = dict(loss_agg_mode="seq-mean-token-mean", use_kl_loss=True, kl_loss_coef=0.1)
    cases.append(
        (
            "remove-padding, 3 uids interleaved, micro-batches of 3",
            vc.actor_config(**kl),
            split,
            dict(micro_batch_size=3, global_batch_size=12, use_remove_padding=True),
        )
    )
    cases.append(
        (
            "remove-padding + use_dynamic_bsz (20 tokens), 3 uids interleaved",
            vc.actor_config(**kl, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=20),
            split,
            dict(micro_batch_size=3, global_batch_size=12, use_remove_padding=True, max_token_len=20),
        )
    )
    print(
        "| setting | grad rel (all) | worst tensor (norm) | worst tensor (max) | loss verl | loss PrefixFlow | dual clip binds |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, actor, data, kw in cases:
        r = vc.compare(folder, actor, data, **kw)
        want, got = r["loss"]
        lower = r["metrics"][0]["actor/pg_clipfrac_lower"]
        print(
            f"| {name} | {r['norm']:.1e} | {r['tensor']:.1e} | {r['max']:.1e} | {sum(want):.7f} | {sum(got):.7f} "
            f"| {lower:.1%} |"
        )
    bf16_table(folder)


def _tau_violations(a: dict, b: dict) -> int:
    """Elements breaking the paper's τ rule |x - y| <= 1e-3 + 1e-2 max(|x|, |y|)."""
    bad = 0
    for k in a:
        x, y = a[k].double(), b[k].double()
        bad += int((x - y).abs().gt(1e-3 + 1e-2 * torch.maximum(x.abs(), y.abs())).sum())
    return bad


def _max_rel(want: dict, got: dict) -> float:
    worst = max(float((got[k] - want[k]).abs().max()) for k in want)
    return worst / max(float(w.abs().max()) for w in want.values())


def bf16_table(folder: str) -> None:
    """verl's default FSDP2 mixed precision (bf16 parameters, fp32 reduce and buffers), remove-padding on and off:
    gradients of PrefixFlow's and verl's bf16 engines against each other and against verl's fp32 engine."""
    from prefixflow.integrations.verl import VENDOR

    bf16 = {"param_dtype": "bf16", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    actor = vc.actor_config(loss_agg_mode="seq-mean-token-mean", use_kl_loss=True, kl_loss_coef=0.1)
    proto = vc.grpo_batch()
    print()
    print(
        "| bf16 (remove-padding) | τ violations ours vs verl bf16 | ours vs fp32 | verl bf16 vs fp32 "
        "| max rel ours vs fp32 | max rel verl bf16 vs fp32 | elements |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for packed in (True, False):
        kw = dict(micro_batch_size=4, global_batch_size=8, use_remove_padding=packed)
        exact, _ = vc.train_once(folder, None, actor, proto, **kw)
        verl_bf16, _ = vc.train_once(folder, None, actor, proto, mixed_precision=bf16, **kw)
        ours, _ = vc.train_once(folder, VENDOR, actor, proto, mixed_precision=bf16, **kw)
        n = sum(g.numel() for g in exact.values())
        print(
            f"| {'on' if packed else 'off'} | {_tau_violations(ours, verl_bf16)} | {_tau_violations(ours, exact)} "
            f"| {_tau_violations(verl_bf16, exact)} | {_max_rel(exact, ours):.1e} | {_max_rel(exact, verl_bf16):.1e} "
            f"| {n} |"
        )


if __name__ == "__main__":
    main()
