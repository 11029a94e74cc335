"""verl 0.9.x's actor update as pf-bench contenders: ``verl`` (verl's own ``FSDPEngineWithLMHead``) and
``verl_prefixflow`` (``prefixflow.integrations.verl.PrefixFlowFSDPEngine``), each one ``engine.train_batch`` of
verl's ``ppo_loss`` on the cell's group: what verl's ``update_actor`` times (zero grad, forward and backward over
the micro-batches, clip, optimizer step).

Needs verl (``make test-verl`` builds ``.venv-verl``). The cell's model is saved and loaded by verl's engine, as a
verl job loads a checkpoint (FSDP2 on one gloo rank, fp32 mixed precision for fp32 cells, bf16 parameters for
bf16 cells). The batch is verl's remove-padding input for ``layout: packed`` (``padded``: its padded forward),
one verl micro-batch of ``microbatch`` rows (null: the whole group), GRPO's defaults: ``token-mean``,
``low_var_kl`` at 0.001. On a CPU a platform is registered through verl's own plugin registry
(:mod:`harness.peers.verl_platform`); verl is not patched.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["VerlEngineContender", "VerlStepStats", "group_batch"]

ENGINES = {"verl": None, "verl_prefixflow": "prefixflow"}  # contender -> VERL_ENGINE_VENDOR
KL_COEF = 0.001  # verl's GRPO examples: actor.kl_loss_coef=0.001, kl_loss_type=low_var_kl


@dataclass
class VerlStepStats:
    """What the cell loop records of a step (``loss``: the sum of verl's per-micro-batch losses)."""

    loss: float
    n_microbatches: int
    prefix_tokens: int
    suffix_tokens: int


def group_batch(group, *, vocab_size: int, seed: int = 0):
    """A prefixflow ``RolloutGroup`` as the ``DataProto`` verl's trainer hands its actor: one uid, left-padded
    prompt, right-padded responses, GRPO's advantage broadcast over each response, old and reference log-probs
    near the model's ``-log(vocab)`` (both sides see the same numbers; they set no speed)."""
    import numpy as np
    from verl import DataProto

    n, p = len(group.responses), int(group.prompt.numel())
    width = max(int(r.numel()) for r in group.responses)
    responses = torch.zeros(n, width, dtype=torch.long)
    attention = torch.zeros(n, p + width, dtype=torch.long)
    attention[:, :p] = 1
    for i, r in enumerate(group.responses):
        responses[i, : r.numel()] = r
        attention[i, p : p + r.numel()] = 1
    prompts = group.prompt.reshape(1, p).expand(n, p).clone()
    response_mask = attention[:, p:].clone()
    gen = torch.Generator().manual_seed(seed)
    centre = -float(np.log(vocab_size))
    old = (centre + 0.1 * torch.randn(n, width, generator=gen)) * response_mask
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention,
        "position_ids": torch.clamp(torch.cumsum(attention, dim=1) - 1, min=0),
        "response_mask": response_mask,
        "advantages": group.advantages.float()[:, None] * response_mask,
        "old_log_probs": old.float(),
        "ref_log_prob": old.float(),
    }
    uid = np.array(["group-0"] * n, dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid}, meta_info={"temperature": 1.0})


class VerlEngineContender:
    """One verl engine per contender (built in ``prepare`` from the cell's model, saved to a temporary folder)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.vendor = ENGINES[name]
        self.cost_model = "prefixflow" if self.vendor else "baseline"
        self.engine = None
        self._dir = None

    def attention_variant(self, device) -> None:
        return None

    def prepare(self, model: nn.Module, cell: Any) -> nn.Module:
        if getattr(cell, "world_size", 1) != 1 or getattr(cell, "groups_per_step", 1) != 1:
            raise ValueError(f"system {self.name!r} runs one group on one rank")
        if getattr(cell, "compile", False) or getattr(cell, "ac", "none") != "none":
            raise ValueError(
                f"system {self.name!r} takes compile: false and ac: none (verl's engine options)"
            )
        if cell.microbatch == "auto":
            raise ValueError(
                f"system {self.name!r} takes a fixed microbatch (verl's micro-batch rows) or null"
            )
        from harness.peers.verl_platform import init_one_rank, select_cpu_platform

        if str(cell.device) == "cpu":
            select_cpu_platform()
        try:
            from verl.trainer.config import CheckpointConfig
            from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
            from verl.workers.engine import EngineRegistry
        except ImportError as exc:
            raise ImportError(
                f"system {self.name!r} needs verl 0.9.x: run pf-bench from .venv-verl (make test-verl)"
            ) from exc
        if self.vendor:
            import prefixflow.integrations.verl  # noqa: F401  (registers the engine)

        init_one_rank()
        self._dir = tempfile.TemporaryDirectory(prefix=f"pf-{self.name}-")
        model.config.architectures = [type(model).__name__]
        model.save_pretrained(self._dir.name)
        packed = cell.layout == "packed"
        precision = "bf16" if cell.dtype == "bf16" else "fp32"
        engine_config = FSDPEngineConfig(
            strategy="fsdp2",
            model_dtype="fp32",
            use_torch_compile=False,
            use_remove_padding=packed,
            use_dynamic_bsz=False,
            mixed_precision={"param_dtype": precision, "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        )
        model_config = HFModelConfig(
            path=self._dir.name,
            load_tokenizer=False,
            override_config={"attn_implementation": "sdpa"},
            use_remove_padding=packed,
        )
        previous = os.environ.get("VERL_ENGINE_VENDOR")
        try:
            os.environ.pop("VERL_ENGINE_VENDOR", None)
            if self.vendor:
                os.environ["VERL_ENGINE_VENDOR"] = self.vendor
            self.engine = EngineRegistry.new(
                model_type="language_model",
                backend="fsdp2",
                model_config=model_config,
                engine_config=engine_config,
                optimizer_config=FSDPOptimizerConfig(lr=1e-6, clip_grad=1.0),
                checkpoint_config=CheckpointConfig(),
            )
        finally:
            os.environ.pop("VERL_ENGINE_VENDOR", None)
            if previous is not None:
                os.environ["VERL_ENGINE_VENDOR"] = previous
        self.engine.initialize()
        return self.engine.module

    def step(self, model: nn.Module, groups: list, cell: Any, observer: Any) -> VerlStepStats:
        from functools import partial

        from verl.utils import tensordict_utils as tu
        from verl.workers.config import FSDPActorConfig
        from verl.workers.utils.losses import ppo_loss
        from verl.workers.utils.padding import left_right_2_no_padding

        (group,) = groups
        n = len(group.responses)
        rows = n if cell.microbatch is None else int(cell.microbatch)
        vocab = int(model.config.get_text_config().vocab_size)
        data = left_right_2_no_padding(group_batch(group, vocab_size=vocab, seed=cell.seed).to_tensordict())
        tu.assign_non_tensor(
            data,
            calculate_entropy=False,
            global_batch_size=n,
            use_remove_padding=cell.layout == "packed",
            use_dynamic_bsz=False,
            max_token_len_per_gpu=None,
            micro_batch_size_per_gpu=rows,
            use_fused_kernels=False,
            global_token_num=None,
        )
        actor = FSDPActorConfig(
            strategy="fsdp2", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=rows, use_dynamic_bsz=False,
            rollout_n=n, loss_agg_mode="token-mean", use_kl_loss=True, kl_loss_coef=KL_COEF,
            kl_loss_type="low_var_kl",
        )  # fmt: skip
        observer.enter("full")
        with self.engine.train_mode():
            out = self.engine.train_batch(data, loss_function=partial(ppo_loss, config=actor))
        observer.exit("full")
        losses = out["loss"] if isinstance(out["loss"], list) else [out["loss"]]
        suffix = sum(int(r.numel()) for r in group.responses)
        p = int(group.prompt.numel())
        return VerlStepStats(
            loss=float(sum(losses)),
            n_microbatches=len(losses),
            prefix_tokens=p if self.vendor else n * p,
            suffix_tokens=suffix,
        )
