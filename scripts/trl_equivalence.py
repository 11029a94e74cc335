"""Measure what the TRL tests bound (docs/hf-trl.md): PrefixFlowGRPOTrainer's update against TRL 1.16's own
``_compute_loss -> backward`` on one micro-batch, per loss type, with tool rollouts (flat groups and the prefix
tree), with LoRA, on more model families, and the first-step check under bf16.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python scripts/trl_equivalence.py

Prints max over tensors of max|d| / max|ref| (the same fixtures, shapes and seeds as the tests).
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "prefixflow" / "integrations"))

import support.trl_fixtures as F  # noqa: E402
import test_trl_losses as L  # noqa: E402
from support.reference import max_rel_diff  # noqa: E402

TMP = Path(tempfile.mkdtemp())


class _Patch:
    """A minimal monkeypatch for fp64_trl outside pytest."""

    def __init__(self):
        self.undo = []

    def setattr(self, obj, name, value):
        self.undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def restore(self):
        for obj, name, value in reversed(self.undo):
            setattr(obj, name, value)


def diff(tr, inputs) -> float:
    _, want, _, got = F.trl_and_prefixflow_grads(tr, inputs)
    return max_rel_diff(got, want)


def rows():
    for case in sorted(L.CASES):
        out = []
        for dtype in (torch.float32, torch.float64):
            patch = _Patch()
            if dtype == torch.float64:
                F.fp64_trl(patch)
            _, _, (_, want, _, got) = L._run(TMP / case, case, dtype)
            patch.restore()
            out.append(max_rel_diff(got, want))
        yield f"| loss `{case}` | {out[0]:.1e} | {out[1]:.1e} |"
    for tree in (False, True):
        out = []
        for dtype in (torch.float32, torch.float64):
            patch = _Patch()
            if dtype == torch.float64:
                F.fp64_trl(patch)
            model = F.model(dtype=dtype)
            if dtype == torch.float64:
                F.fp64_norms(model)
            tr = F.trainer(TMP / "tools", model=model, loss_type="grpo", rollout_func=F.multi_turn_rollout,
                           prefixflow_tree=tree)  # fmt: skip
            out.append(diff(tr, F.micro_batch(tr)))
            patch.restore()
        yield f"| tool rollouts, {'prefix tree' if tree else 'flat groups + loss_masks'} | {out[0]:.1e} | {out[1]:.1e} |"
    import peft

    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])  # fmt: skip
    tr = F.trainer(TMP / "lora", loss_type="dapo", peft_config=lora)
    yield f"| LoRA (q/k/v/o + MLP), dapo, adapter grads | {diff(tr, F.micro_batch(tr)):.1e} | - |"
    for family in ("gemma3", "phi3", "olmo2"):
        tr = F.trainer(
            TMP / family, model=F.model(family), loss_type="dapo", rollout_func=F.multi_turn_rollout
        )
        yield f"| {family}, tool tree, dapo | {diff(tr, F.micro_batch(tr)):.1e} | - |"
    tr = F.trainer(
        TMP / "bf16", bf16=True, loss_type="dapo", prefixflow_layout="packed", verify_first_step=True
    )
    tr.train()
    yield f"| bf16 training, first-step check (in fp32; tolerance 1e-4) | {tr.state.log_history[0]['prefixflow/verify_max_rel_diff']:.1e} | - |"


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    print("| comparison (gradients, max rel) | fp32 | fp64 |\n| --- | --- | --- |")
    for row in rows():
        print(row, flush=True)
