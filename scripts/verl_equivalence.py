"""verl 0.9.1's FSDP engine vs PrefixFlow's: one train_batch each on the same DataProto (the tests' shapes and seeds).

    .venv-verl/bin/python scripts/verl_equivalence.py      (after make test-verl; CPU, fp32, one gloo rank)

Prints, per setting, the gradient difference (over all parameters; worst parameter tensor by norm and by max),
verl's loss and PrefixFlow's, and verl's dual-clip metric (pg_clipfrac_lower: the share of tokens it binds on).
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "verl_integration"))
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
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


if __name__ == "__main__":
    main()
