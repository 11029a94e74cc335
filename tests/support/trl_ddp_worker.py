"""Runs on each of 2 ranks (``harness.local_ranks`` or torchrun): for every case, one SGD step of TRL's
``GRPOTrainer`` and of ``PrefixFlowGRPOTrainer`` under the same launch and seed (accelerate's MULTI_CPU state,
DDP over gloo); rank 0 writes the max relative difference of the weights after the step and of the reduced
gradients the first optimizer step applies, per case.

``python -m harness.local_ranks --nproc-per-node=2 tests/support/trl_ddp_worker.py OUT.json``
"""

from __future__ import annotations

import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback

CASES = {
    "dapo": dict(loss_type="dapo"),
    "grpo-ga2": dict(loss_type="grpo", gradient_accumulation_steps=2, steps_per_generation=2, prompts=8),
    "tools-tree": dict(loss_type="grpo", tools=True),
    "lora-sapo": dict(loss_type="sapo", lora=True),
    "verify-ga2": dict(
        loss_type="dapo",
        gradient_accumulation_steps=2,
        steps_per_generation=2,
        prompts=8,
        verify_first_step=True,
    ),
}


def _rel(got, want) -> float:
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        worst = max(worst, float((g - w).abs().max()) / (float(w.abs().max()) or 1.0))
    return worst


def _step(cls, folder: Path, options: dict):
    import support.trl_fixtures as F

    options = dict(options)
    options["dataset"] = F.dataset(options.pop("prompts", 4))
    if options.pop("tools", False):
        options["rollout_func"] = F.multi_turn_rollout
    if options.pop("lora", False):
        import peft

        options["peft_config"] = peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        )  # fmt: skip
    tr = F.trainer(folder, cls=cls, **options)
    params = [p for p in tr.model.parameters() if p.requires_grad]
    grads = []

    class FirstGradients(TrainerCallback):  # the reduced gradients the first optimizer step applies
        def on_pre_optimizer_step(self, *args, **kwargs):
            if not grads:
                grads.extend(p.grad.detach().clone() for p in params)

    tr.add_callback(FirstGradients())
    tr.train()
    after = [p.detach().clone() for p in params]
    world = tr.accelerator.num_processes
    logged = tr.state.log_history[0]
    return after, grads, world, logged


def main(out: str) -> None:
    from trl import GRPOTrainer

    from prefixflow.integrations.trl import PrefixFlowGRPOTrainer

    results = {}
    tmp = Path(tempfile.mkdtemp())
    for name, options in CASES.items():
        try:
            base, base_step, world, _ = _step(GRPOTrainer, tmp / f"{name}-trl", options)
            again, _, _, _ = _step(GRPOTrainer, tmp / f"{name}-trl2", options)
            pf, pf_step, _, logged = _step(PrefixFlowGRPOTrainer, tmp / f"{name}-pf", options)
            flat = torch.cat([p.flatten() for p in pf])
            gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, flat)
            results[name] = {
                "world": world,
                "trl_deterministic": _rel(again, base),
                "params": _rel(pf, base),
                "grads": _rel(pf_step, base_step),
                "grad_size": max(float(s.abs().max()) for s in base_step),
                "ranks_agree": float(max((g - gathered[0]).abs().max() for g in gathered)),
                "group_size": logged.get("prefixflow/group_size"),
                "trees": logged.get("prefixflow/trees"),
                "verified": logged.get("prefixflow/verify_max_rel_diff"),
            }
        except Exception:  # noqa: BLE001 - reported to the test
            results[name] = {"error": traceback.format_exc()[-3000:]}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()  # no rank leaves while another is still in a collective
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
