"""``PrefixFlowGRPOTrainer``: TRL's ``GRPOTrainer`` whose actor update runs PrefixFlow's three phases.

Swap the class; keep the constructor and the ``GRPOConfig``::

    trainer = PrefixFlowGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...), train_dataset=ds)
    trainer.train()

Generation, rewards, advantages, reference/old log-probs, shuffling and the split into micro-batches are TRL's
own. Only ``training_step`` changes: TRL's ``compute_loss -> backward`` becomes, for each prompt of the
micro-batch, one ``prefixflow.train_group`` over its completions (the prompt's K/V are computed once).

What "equals TRL" means. For each micro-batch ``_prepare_inputs`` hands to ``training_step`` (``B`` completions,
``T`` completion tokens, ``GA`` = ``current_gradient_accumulation_steps``), the gradient added to ``param.grad``
is that of the loss ``GRPOTrainer._compute_loss`` returns for the same micro-batch, with the per-token loss
``l = -min(r A, clip(r, 1-epsilon, 1+epsilon_high) A) + beta KL`` (``r`` token- or sequence-level, ``delta`` cap,
KL times ``r`` with ``use_bias_correction_kl``, logits divided by ``temperature``) and TRL's normalisers:

- ``grpo``: ``(1/(B GA)) sum_b mean_t l``   -> per prompt group: ``seq-mean-token-mean`` x ``N_g/(B GA)``;
- ``bnpo``: ``sum l / (T GA)``              -> ``token-mean`` x ``T_g/(T GA)`` (normalised per micro-batch);
- ``dr_grpo``: ``sum l / (B L_max GA)``     -> ``seq-mean-token-sum-norm`` (``L_max`` = max_completion_length)
  x ``N_g/(B GA)``;
- ``dapo``: ``sum l / (items/processes x GA/steps_per_generation)`` -> ``token-mean`` x ``T_g`` / that.

Completions whose mask is empty (``mask_truncated_completions``) count in ``B`` and add nothing, as in TRL. The
only differences are floating point: TRL runs left-padded prompts at shifted positions (RoPE is relative) and its
fused LM head accumulates in fp32. ``verify_first_step=True`` checks the first update against TRL's own path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

try:
    from trl import GRPOTrainer
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("prefixflow.integrations.trl needs TRL: pip install 'prefixflow[hf]'") from exc

from .. import PrefixFlowConfig, RolloutGroup, apply_prefixflow, train_group
from ..loss import LossConfig
from ..schedule import check_group
from . import hf  # noqa: F401  (registers the HF adapter and attention)

__all__ = ["PrefixFlowGRPOTrainer", "SUPPORTED_LOSS_TYPES", "GroupPlan", "plan_groups", "VERIFY_TOLERANCE"]

SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
# Max relative gradient difference verify_first_step accepts, by compute dtype.
VERIFY_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}


@dataclass
class GroupPlan:
    """One prompt's completions in a micro-batch and the loss config that gives them TRL's weight."""

    rows: list[int]
    group: RolloutGroup
    loss_config: LossConfig


def plan_groups(
    inputs: dict,
    *,
    loss_type: str,
    beta: float,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None,
    importance_sampling_level: str,
    use_bias_correction_kl: bool,
    temperature: float,
    max_completion_length: int,
    gradient_accumulation_steps: int,
    num_processes: int = 1,
    steps_per_generation: int = 1,
) -> list[GroupPlan]:
    """Group a TRL micro-batch by prompt and give each group the loss config that reproduces TRL's loss.

    ``inputs``: what ``GRPOTrainer._prepare_inputs`` returns (``prompt_ids/mask`` left-padded,
    ``completion_ids/mask`` right-padded, ``advantages`` ``[B]``, optional ``old_per_token_logps`` and
    ``ref_per_token_logps``). Raises ``ValueError`` for what PrefixFlow cannot reproduce.
    """
    for key in ("tool_mask", "importance_sampling_ratio", "pixel_values"):
        if inputs.get(key) is not None:
            raise ValueError(f"TRL input {key!r} is not supported by PrefixFlowGRPOTrainer")
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"].bool()
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"].bool()
    advantages = inputs["advantages"]
    if advantages.dim() != 1:
        raise ValueError(f"advantages must be one value per completion, got shape {tuple(advantages.shape)}")
    old, ref = inputs.get("old_per_token_logps"), inputs.get("ref_per_token_logps") if beta != 0.0 else None
    lengths = completion_mask.sum(-1).tolist()
    b = len(lengths)
    tokens = sum(lengths)
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for row, n in enumerate(lengths):
        if not bool(completion_mask[row, :n].all()):
            raise ValueError(
                f"completion_mask row {row} has gaps; only right-padded completions are supported"
            )
        if n > 0:
            by_prompt.setdefault(tuple(prompt_ids[row][prompt_mask[row]].tolist()), []).append(row)

    ga = gradient_accumulation_steps
    plans = []
    for prompt, rows in by_prompt.items():
        group_tokens = sum(lengths[r] for r in rows)
        norm_len = None
        if loss_type == "grpo":
            aggregation, weight = "seq-mean-token-mean", len(rows) / (b * ga)
        elif loss_type == "bnpo":
            aggregation, weight = "token-mean", group_tokens / (max(tokens, 1) * ga)
        elif loss_type == "dr_grpo":
            aggregation, weight = "seq-mean-token-sum-norm", len(rows) / (b * ga)
            norm_len = max_completion_length
        elif loss_type == "dapo":
            items = float(inputs["num_items_in_batch"].clamp(min=1.0))
            aggregation, weight = (
                "token-mean",
                group_tokens / (items / num_processes * ga / steps_per_generation),
            )
        else:
            raise ValueError(
                f"loss_type {loss_type!r} unsupported; PrefixFlow supports {SUPPORTED_LOSS_TYPES}"
            )

        group = RolloutGroup(
            prompt=torch.tensor(prompt, dtype=torch.long, device=prompt_ids.device),
            responses=[completion_ids[r, : lengths[r]] for r in rows],
            advantages=advantages[rows],
            old_logprobs=_per_row(old, rows, lengths),
            ref_logprobs=_per_row(ref, rows, lengths),
        )
        config = LossConfig(
            clip_eps_low=epsilon_low,
            clip_eps_high=epsilon_high,
            kl_coef=beta,
            aggregation=aggregation,
            importance_sampling=importance_sampling_level,
            ratio_cap=delta,
            kl_ratio_correction=bool(use_bias_correction_kl) and beta != 0.0,
            temperature=temperature,
            norm_len=norm_len,
            group_weight=weight,
        )
        plans.append(GroupPlan(rows, group, config))
    return plans


def _per_row(t: torch.Tensor | None, rows: list[int], lengths: list[int]) -> list[torch.Tensor] | None:
    return None if t is None else [t[r, : lengths[r]] for r in rows]


class PrefixFlowGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` with PrefixFlow's actor update; same constructor and ``GRPOConfig``.

    Extra keyword arguments: ``prefixflow_config`` (:class:`prefixflow.PrefixFlowConfig`), ``prefixflow_layout``
    (``"padded"``/``"packed"``), ``prefixflow_microbatch`` (completions per suffix microbatch, None = all of a
    prompt's), ``verify_first_step`` (compare the first micro-batch's gradients with TRL's own
    ``compute_loss -> backward`` and raise beyond ``verify_tolerance``, default by dtype: ``VERIFY_TOLERANCE``).
    A TRL option PrefixFlow does not reproduce raises ``ValueError`` here, at construction.
    """

    def __init__(
        self,
        *args,
        prefixflow_config: PrefixFlowConfig | None = None,
        prefixflow_layout: str = "padded",
        prefixflow_microbatch: int | None = None,
        verify_first_step: bool = False,
        verify_tolerance: float | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self._refuse_unsupported()
        if prefixflow_layout not in ("padded", "packed"):
            raise ValueError(f"prefixflow_layout must be 'padded' or 'packed', got {prefixflow_layout!r}")
        self.prefixflow_layout = prefixflow_layout
        self.prefixflow_microbatch = prefixflow_microbatch
        self.verify_first_step = bool(verify_first_step)
        self.verify_tolerance = verify_tolerance
        self._prefixflow_verified = False
        apply_prefixflow(self.model, prefixflow_config)

    def _refuse_unsupported(self) -> None:
        args = self.args
        refusals = {
            f"loss_type={self.loss_type!r} (supported: {SUPPORTED_LOSS_TYPES})": (
                self.loss_type not in SUPPORTED_LOSS_TYPES
            ),
            "top_entropy_quantile < 1.0 (entropy mask)": self.top_entropy_quantile < 1.0,
            "off_policy_mask_threshold": self.off_policy_mask_threshold is not None,
            "entropy_coef / use_adaptive_entropy (entropy bonus)": self._entropy_bonus_enabled,
            "use_vllm with vllm_importance_sampling_correction": (
                self.use_vllm and self.vllm_importance_sampling_correction
            ),
            "tools / environment_factory (tool masks)": bool(self.tools)
            or self.environment_factories is not None,
            "vision-language models": self._is_vlm,
            "MoE router aux loss": self.aux_loss_enabled,
            "multi-process training (DDP/FSDP/DeepSpeed)": self.accelerator.num_processes > 1,
            "fp16 with a gradient scaler": self.accelerator.scaler is not None,
        }
        bad = [name for name, refused in refusals.items() if refused]
        if bad:
            raise ValueError(f"PrefixFlowGRPOTrainer does not support: {'; '.join(bad)}")
        if not isinstance(self.accelerator.unwrap_model(self.model), hf.PreTrainedModel):
            raise ValueError(
                "PrefixFlowGRPOTrainer needs a transformers PreTrainedModel (PEFT is not supported)"
            )
        if args.gradient_accumulation_steps < 1:
            raise ValueError("gradient_accumulation_steps must be >= 1")

    # -- the actor update -----------------------------------------------------------------------------
    def training_step(self, model: nn.Module, inputs, num_items_in_batch=None) -> torch.Tensor:
        """TRL's training step with ``compute_loss -> backward`` replaced by one ``train_group`` per prompt."""
        time_before = time.perf_counter()
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        if self.verify_first_step and not self._prefixflow_verified:
            loss = self._verified_update(model, inputs)
        else:
            loss = self._prefixflow_update(model, inputs)
        self._step += 1
        self._current_train_step_time += time.perf_counter() - time_before
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return loss

    def _plan(self, inputs) -> list[GroupPlan]:
        return plan_groups(
            inputs,
            loss_type=self.loss_type,
            beta=self.beta,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            delta=self.args.delta,
            importance_sampling_level=self.importance_sampling_level,
            use_bias_correction_kl=self.args.use_bias_correction_kl,
            temperature=self.temperature,
            max_completion_length=self.max_completion_length,
            gradient_accumulation_steps=self.current_gradient_accumulation_steps,
            num_processes=self.accelerator.num_processes,
            steps_per_generation=self.args.steps_per_generation,
        )

    def _prefixflow_update(self, model: nn.Module, inputs) -> torch.Tensor:
        unwrapped = self.accelerator.unwrap_model(model)
        plans = self._plan(inputs)
        options = {"layout": self.prefixflow_layout, "microbatch": self.prefixflow_microbatch, "loss": "grpo"}
        for plan in plans:  # every group is valid before the first one changes a gradient
            check_group(unwrapped, plan.group, loss_config=plan.loss_config, **options)
        total = 0.0
        with self.compute_loss_context_manager(), self.accelerator.autocast():
            for plan in plans:
                total += train_group(unwrapped, plan.group, loss_config=plan.loss_config, **options).loss
        if not plans:  # every completion masked: TRL back-propagates a zero loss, i.e. zero gradients
            for p in unwrapped.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        else:
            metrics = self._metrics["train"]
            metrics["prefixflow/group_size"].append(sum(p.group.n for p in plans) / len(plans))
            shared = sum((p.group.n - 1) * (p.group.prompt_len - 1) for p in plans)
            metrics["prefixflow/prefix_tokens_reused"].append(float(shared))
        return torch.tensor(total, device=self.accelerator.device)

    def _verified_update(self, model: nn.Module, inputs) -> torch.Tensor:
        """Run TRL's plain path and PrefixFlow on the same micro-batch; raise if their gradients differ."""
        params = [p for p in model.parameters() if p.requires_grad]
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        with self.compute_loss_context_manager():
            want_loss = self.compute_loss(model, inputs)
        self.accelerator.backward(want_loss)
        want_loss = float(want_loss.detach())
        want = [p.grad for p in params]
        for p in params:
            p.grad = None
        loss = self._prefixflow_update(model, inputs)
        worst, where = 0.0, None
        for (name, p), w in zip(
            ((n, p) for n, p in model.named_parameters() if p.requires_grad), want, strict=True
        ):
            g = p.grad
            if w is None and g is None:
                continue
            if w is None or g is None:
                worst, where = float("inf"), name
                break
            diff = float((g - w).abs().max()) / (float(w.abs().max()) or 1.0)
            if diff > worst:
                worst, where = diff, name
        loss_diff = abs(float(loss) - want_loss) / (abs(want_loss) or 1.0)
        tolerance = (
            self.verify_tolerance if self.verify_tolerance is not None else self._default_tolerance(model)
        )
        for p, s in zip(params, saved, strict=True):
            p.grad = p.grad if s is None else (s if p.grad is None else s + p.grad)
        if worst > tolerance:  # the update is the gradient; a loss near 0 (zero-mean advantages) has no scale
            raise RuntimeError(
                f"PrefixFlow's first update differs from TRL's: max relative gradient difference {worst:.3e} "
                f"(at {where}), loss difference {loss_diff:.3e}; tolerance {tolerance:.1e}"
            )
        self._prefixflow_verified = True
        self._metrics["train"]["prefixflow/verify_max_rel_diff"].append(worst)
        return loss

    def _default_tolerance(self, model: nn.Module) -> float:
        dtype = next(model.parameters()).dtype
        if self.args.bf16 or self.args.fp16:
            dtype = torch.bfloat16
        return VERIFY_TOLERANCE.get(dtype, 5e-2)
