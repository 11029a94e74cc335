"""The supervised warm start every Claim-2 run starts from, cached as ``_state/warmstart.safetensors``."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from harness.rl import multiturn
from harness.rl.io import load_tensors, save_tensors, state_tensors
from harness.rl.loop import build_model_for, task_of
from harness.rl.ranks import Ranks
from harness.rl.spec import RLSpec
from harness.rl.task import mean_reward, warm_start
from prefixflow.model.dtypes import DTYPES
from prefixflow.rl import sync_weights

__all__ = ["warm_start_state"]


def warm_start_state(
    spec: RLSpec,
    state: Path,
    device: torch.device,
    base: dict[str, Any],
    log: Callable[[str], None],
    ranks: Ranks | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The shared initial weights (the warm-started model, cached under ``state``) and the record of its
    reward on the RL task (the level every run starts from).

    On many ranks the warm start trains the model parallelized like the loop's actor, every rank receives
    its whole weights, and the reward measured by rank 0's full replica is every rank's."""
    ranks = ranks or Ranks.single()
    path = state / "warmstart.safetensors"
    identity = spec.warm_start_identity()
    task = task_of(spec)
    tensors = None
    if ranks.from_main(path.exists()):
        tensors, meta = load_tensors(path)
        if ranks.from_main(meta.get("identity")) != identity:
            log(f"warm start at {path} is from another configuration; recomputing")
            tensors = None
    ws, loop = spec.warm_start, spec.loop
    if tensors is None:
        model = ranks.parallelize(build_model_for(spec, task, torch.float32, device))
        turns = spec.task.kind == "multiturn"
        if turns:
            log(
                f"warm start: {ws.steps} steps x {ws.batch} multi-turn episodes (P={task.prompt_len}, a "
                f"well-formed response {task.response_len} tokens: call {task.turn1_len}, reply {task.reply_len})"
            )
            losses = multiturn.warm_start(
                model, task, steps=ws.steps, batch=ws.batch, lr=ws.lr, seed=spec.data_seed + 1,
                label_smoothing=ws.label_smoothing,
            )  # fmt: skip
        else:
            log(
                f"warm start: {ws.steps} steps x {ws.batch} prompts of {ws.passages} passages (the RL prompts "
                f"have {task.n_passages}: P={task.prompt_len}, S={task.response_len}, r={task.prefix_ratio:.3f})"
            )
            losses = warm_start(
                model, task, steps=ws.steps, batch=ws.batch, lr=ws.lr, seed=spec.data_seed + 1,
                passages=ws.passages, label_smoothing=ws.label_smoothing,
            )  # fmt: skip
        tensors = state_tensors(model, "w.")
        rollout = build_model_for(spec, task, DTYPES[loop.dtype], device)
        sync_weights(model, rollout)
        del model
        reward, exact = (multiturn.mean_reward if spec.task.kind == "multiturn" else mean_reward)(
            rollout,
            task,
            prompts=ws.eval_prompts,
            n=loop.n,
            max_new_tokens=loop.max_new_tokens,
            temperature=loop.temperature,
            seed=spec.data_seed + 2,
        )
        meta = ranks.from_main(
            {
                "identity": identity,
                "final_loss": repr(losses[-1] if losses else float("nan")),
                "reward": repr(reward),
                "exact_match": repr(exact),
            }
        )
        save_tensors(path, tensors, meta, root=state.parent)
    record = {
        **base,
        "record_kind": "rl_warmstart",
        "system": "baseline",
        "dtype": loop.dtype,
        "run": "warmstart",
        "step": 0,
        "reward_mean": float(meta["reward"]),
        "exact_match": float(meta["exact_match"]),
        "loss": float(meta["final_loss"]),
        "warm_start_steps": ws.steps,
        "warm_start_passages": ws.passages if spec.task.kind == "retrieval" else None,
        "timestamp": datetime.now(UTC).isoformat(timespec="milliseconds"),
    }
    log(
        f"warm start: reward {record['reward_mean']:.3f} (exact {record['exact_match']:.3f}) on "
        f"{ws.eval_prompts} RL prompts x {loop.n} samples"
    )
    return {k.removeprefix("w."): v for k, v in tensors.items()}, record
