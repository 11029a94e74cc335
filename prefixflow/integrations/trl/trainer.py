"""``PrefixFlowGRPOTrainer``: TRL's ``GRPOTrainer`` whose actor update runs PrefixFlow's three phases.

Swap the class; keep the constructor and the ``GRPOConfig``::

    trainer = PrefixFlowGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...), train_dataset=ds)
    trainer.train()

Generation (tools and environments included), rewards, advantages, reference/old log-probs, shuffling and the
split into micro-batches are TRL's own. Only ``training_step`` changes: TRL's ``compute_loss -> backward``
becomes one ``prefixflow.train_group`` per prompt of the micro-batch (the prompt's K/V computed once), or one
over the micro-batch's prefix tree (:mod:`.plan`: multi-turn tool rollouts, prompts sharing a system prompt).
The gradient equals that of TRL's ``_compute_loss`` for the same micro-batch (definition in :mod:`.plan`); the
only differences are floating point (TRL runs left-padded prompts at shifted positions, RoPE being relative,
and its LM head may accumulate in fp32). ``verify_first_step=True`` checks the first update against TRL's own
path, in fp32 when the weights are fp32 (TRL's bf16 is autocast over fp32 weights). FSDP2 (PrefixFlow's own
``fully_shard``, ``prefixflow_parallel``): :mod:`.sharding`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import torch
from torch import nn

try:
    from trl import GRPOTrainer
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("prefixflow.integrations.trl needs TRL: pip install 'prefixflow[hf]'") from exc

from ... import PrefixFlowConfig, apply_prefixflow, train_group
from ...memory.budget import AUTO
from ...parallel import ParallelDims, parallelize
from ...runtime import runtime_of
from ...schedule.driver import check_group
from .. import hf
from ..hf_vision import FAMILIES
from . import sharding, vision
from .options import check_options, min_shared_tokens_for
from .plan import SUPPORTED_LOSS_TYPES, TrainingUnit, check_positions, plan_groups, reused_tokens

__all__ = ["PrefixFlowGRPOTrainer", "VERIFY_TOLERANCE"]

# Max relative gradient difference verify_first_step accepts, by the dtype the check computes in.
VERIFY_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}


class PrefixFlowGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` with PrefixFlow's actor update; same constructor and ``GRPOConfig``.

    Extra keyword arguments: ``prefixflow_config`` (:class:`prefixflow.PrefixFlowConfig`), ``prefixflow_layout``
    (``"padded"``/``"packed"``), ``prefixflow_microbatch`` (completions, or tree paths, per suffix microbatch;
    None = all), ``prefixflow_tree`` (True / False / ``"auto"``, see :func:`.plan.plan_groups`),
    ``prefixflow_min_shared_tokens`` (trees' ``build_tree(min_shared_tokens=...)``; None: 1, or 2 on models with
    recurrent layers), ``prefixflow_metrics`` (log TRL's ``kl``, ``entropy`` and ``clip_ratio/*`` on every optimizer step that logs,
    from one no-grad forward of TRL's own loss per micro-batch; False skips that forward), ``verify_first_step``
    (compare the first micro-batch's gradients with TRL's own ``compute_loss -> backward``, in fp32 when the
    weights are fp32, and raise beyond ``verify_tolerance``, default by dtype: ``VERIFY_TOLERANCE``).
    ``peft_config`` (LoRA) works as in TRL. A TRL option PrefixFlow does not reproduce raises ``ValueError`` here.

    Vision-language GRPO as in TRL (images in the dataset's ``image``/``images`` column, the model's processor as
    ``processing_class``) for :data:`.vision.TRAINED_VLM_TYPES`: each prompt's images go to its group as
    ``prompt_inputs``; the tower runs once per group.

    FSDP2: ``prefixflow_parallel={"dp_shard": N}`` (N = the number of processes) shards the model with
    :func:`prefixflow.parallel.parallelize` once TRL has set it up; a model the caller already sharded that way
    is taken as it is. accelerate then neither moves it nor wraps it in DDP; each micro-batch's gradients are
    reduce-scattered once, averaged over the processes as DDP averages TRL's.
    """

    def __init__(
        self,
        *args,
        prefixflow_config: PrefixFlowConfig | None = None,
        prefixflow_layout: str = "padded",
        prefixflow_microbatch: int | None = None,
        prefixflow_tree: bool | str = "auto",
        prefixflow_metrics: bool = True,
        prefixflow_parallel: ParallelDims | dict | None = None,
        prefixflow_min_shared_tokens: int | str | None = None,
        verify_first_step: bool = False,
        verify_tolerance: float | None = None,
        **kwargs,
    ):
        check_options(
            prefixflow_layout, prefixflow_microbatch, prefixflow_tree, prefixflow_min_shared_tokens,
            verify_tolerance,
        )  # fmt: skip
        peft_config = kwargs.get("peft_config")
        super().__init__(*args, **kwargs)
        self._refuse_unsupported()
        dims = None if prefixflow_parallel is None else ParallelDims.of(prefixflow_parallel)
        inner = self._prefixflow_model(self.accelerator.unwrap_model(self.model))
        self._prefixflow_gathered = None  # the full weights save_model gathered for _save (sharded models)
        self._prefixflow_sharded = sharding.check(
            inner,
            dims,
            self.args,
            world=self.accelerator.num_processes,
            peft=peft_config is not None or hasattr(self.model, "peft_config"),
            # transformers' own distributed loading; before 5.2x (5.17) the Trainer has neither it nor the flag
            foreign=getattr(self, "is_distributed_loading_by_transformers", False),
        )
        config = prefixflow_config or runtime_of(inner, create=True).config or PrefixFlowConfig()
        if prefixflow_microbatch == AUTO and config.memory_budget_bytes is None:
            raise ValueError(
                "prefixflow_microbatch='auto' needs a memory budget: pass prefixflow_config=PrefixFlowConfig("
                "memory_budget_bytes=...), or an int prefixflow_microbatch"
            )
        self.prefixflow_layout = prefixflow_layout
        self.prefixflow_microbatch = prefixflow_microbatch
        self.prefixflow_tree = prefixflow_tree
        self.prefixflow_metrics = bool(prefixflow_metrics)
        self.verify_first_step = bool(verify_first_step)
        self.verify_tolerance = verify_tolerance
        self._prefixflow_verified = False
        if prefixflow_config is not None or runtime_of(inner, create=True).config is None:
            apply_prefixflow(inner, prefixflow_config)
        self.prefixflow_min_shared_tokens = min_shared_tokens_for(inner, prefixflow_min_shared_tokens)
        if dims is not None:
            parallelize(inner, dims)
        if self._prefixflow_sharded:
            sharding.keep_out_of_ddp(self.accelerator, inner)

    @staticmethod
    def _prefixflow_model(model: nn.Module) -> nn.Module:
        """The transformers model PrefixFlow trains: PEFT's base model (LoRA layers sit inside its projections)."""
        get_base = getattr(model, "get_base_model", None)
        return get_base() if callable(get_base) and not isinstance(model, hf.PreTrainedModel) else model

    def _refuse_unsupported(self) -> None:
        args = self.args
        inner = self._prefixflow_model(self.accelerator.unwrap_model(self.model))
        model_type = getattr(getattr(inner, "config", None), "model_type", None)
        refusals = {
            f"loss_type={self.loss_type!r} (supported: {SUPPORTED_LOSS_TYPES})": (
                self.loss_type not in SUPPORTED_LOSS_TYPES
            ),
            "top_entropy_quantile < 1.0 (the entropy mask needs every completion token's entropy before any "
            "loss is formed; PrefixFlow forms the loss per suffix microbatch; use top_entropy_quantile=1.0)": (
                self.top_entropy_quantile < 1.0
            ),
            "entropy_coef / use_adaptive_entropy (the entropy bonus needs the full-vocabulary entropy at every "
            "token; PrefixFlow's LM head gives log-probs of the sampled tokens only; set entropy_coef=0)": (
                self._entropy_bonus_enabled
            ),
            "use_vllm with vllm_importance_sampling_correction (set it False)": (
                self.use_vllm and self.vllm_importance_sampling_correction
            ),
            f"vision-language model type {model_type!r} (trained: {list(vision.TRAINED_VLM_TYPES)})": (
                self._is_vlm and model_type not in vision.TRAINED_VLM_TYPES
            ),
            "MoE router aux loss (set output_router_logits=False)": self.aux_loss_enabled,
            "FSDP or DeepSpeed through accelerate (DDP runs; for FSDP2 pass prefixflow_parallel={'dp_shard': N})": (
                self.is_fsdp_enabled or self.is_deepspeed_enabled
            ),
            "fp16 with a gradient scaler (use bf16)": self.accelerator.scaler is not None,
        }
        bad = [name for name, refused in refusals.items() if refused]
        if bad:
            raise ValueError(f"PrefixFlowGRPOTrainer does not support: {'; '.join(bad)}")
        if not isinstance(inner, hf.PreTrainedModel):
            raise ValueError(
                "PrefixFlowGRPOTrainer needs a transformers PreTrainedModel (or a PEFT model around one), "
                f"got {type(inner).__name__}"
            )
        if args.gradient_accumulation_steps < 1:
            raise ValueError("gradient_accumulation_steps must be >= 1")

    # -- the actor update -----------------------------------------------------------------------------
    def training_step(self, model: nn.Module, inputs, num_items_in_batch=None) -> torch.Tensor:
        """TRL's training step with ``compute_loss -> backward`` replaced by PrefixFlow's ``train_group``."""
        time_before = time.perf_counter()
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        plans = self._checked_plans(model, inputs)  # bad input raises here, before any forward or gradient
        if self.verify_first_step and not self._prefixflow_verified:
            loss = self._verified_update(model, inputs, plans)
        else:
            if self.prefixflow_metrics and self._logs_this_step():
                with torch.no_grad(), self.compute_loss_context_manager():
                    super()._compute_loss(model, inputs)  # TRL's own kl / entropy / clip_ratio metrics
            loss = self._prefixflow_update(model, inputs, plans)
        self._step += 1
        self._current_train_step_time += time.perf_counter() - time_before
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return loss

    def _logs_this_step(self) -> bool:
        """Whether the optimizer step this micro-batch belongs to is one the Trainer logs."""
        args, step = self.args, self.state.global_step + 1
        if args.logging_strategy != "steps":
            return True
        every = (
            args.logging_steps
            if args.logging_steps >= 1
            else max(1, int(args.logging_steps * self.state.max_steps))
        )
        return step % every == 0 or (args.logging_first_step and step == 1)

    def _plan(self, inputs) -> list[TrainingUnit]:
        args = self.args
        row_inputs = None
        if self._is_vlm:
            inner = self._prefixflow_model(self.accelerator.unwrap_model(self.model))
            row_inputs = vision.row_inputs(inputs, FAMILIES[inner.config.model_type].placeholder_ids(inner))
        policy_options = {}
        if self.loss_type == "sapo":
            policy_options.update(
                sapo_tau_pos=args.sapo_temperature_pos, sapo_tau_neg=args.sapo_temperature_neg
            )
        if self.loss_type == "vespo":
            policy_options.update(
                vespo_k_pos=args.vespo_k_pos, vespo_lambda_pos=args.vespo_lambda_pos,
                vespo_k_neg=args.vespo_k_neg, vespo_lambda_neg=args.vespo_lambda_neg,
            )  # fmt: skip
        if self.off_policy_mask_threshold is not None:
            if inputs.get("sampling_per_token_logps") is not None:
                raise ValueError(
                    "off_policy_mask_threshold with vLLM sampling log-probs is not supported by "
                    "PrefixFlowGRPOTrainer (use it without use_vllm)"
                )
            policy_options["off_policy_threshold"] = self.off_policy_mask_threshold
        return plan_groups(
            inputs,
            loss_type=self.loss_type,
            beta=self.beta,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            delta=args.delta,
            importance_sampling_level=self.importance_sampling_level,
            use_bias_correction_kl=args.use_bias_correction_kl,
            temperature=self.temperature,
            max_completion_length=self.max_completion_length,
            gradient_accumulation_steps=self.current_gradient_accumulation_steps,
            num_processes=self.accelerator.num_processes,
            steps_per_generation=args.steps_per_generation,
            policy_options=policy_options,
            tree=self.prefixflow_tree,
            min_shared_tokens=self.prefixflow_min_shared_tokens,
            row_inputs=row_inputs,
        )

    def _checked_plans(self, model: nn.Module, inputs) -> list[TrainingUnit]:
        """The micro-batch's groups (or tree), every one checked before the first one changes a gradient; a
        VLM group's refusal names its micro-batch rows."""
        inner = self._prefixflow_model(self.accelerator.unwrap_model(model))
        check_positions(inner, inputs)
        plans = self._plan(inputs)
        options = {"layout": self.prefixflow_layout, "microbatch": self.prefixflow_microbatch, "loss": "grpo"}
        for plan in plans:
            try:
                check_group(inner, plan.group, loss_config=plan.loss_config, **options)
            except ValueError as err:
                if not self._is_vlm:
                    raise
                raise vision.refusal(err, plan.rows) from None
        return plans

    def _prefixflow_update(self, model: nn.Module, inputs, plans=None) -> torch.Tensor:
        if self.accelerator.num_processes == 1 or self._prefixflow_sharded:
            return self._local_update(model, inputs, plans)
        # DDP: train_group runs on the unwrapped model, so DDP's reducer never sees it; this micro-batch's
        # gradient is averaged over the processes here (one all-reduce), as DDP averages TRL's.
        params = [p for p in model.parameters() if p.requires_grad]
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        with _no_sync(model):
            loss = self._local_update(model, inputs, plans)
        flat = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten() for p in params])
        torch.distributed.all_reduce(flat)
        flat /= self.accelerator.num_processes
        offset = 0
        for p, s in zip(params, saved, strict=True):
            g = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            p.grad = g.clone() if s is None else s + g
        return loss

    def _local_update(self, model: nn.Module, inputs, plans=None) -> torch.Tensor:
        """This process's groups into ``param.grad`` (``plans``: :meth:`_checked_plans`'s, or made here). Sharded
        (FSDP2): every unit is gathered once for the micro-batch (ranks may train different numbers of groups)
        and reduce-scattered once at its end; the objective is divided by the number of processes, because FSDP
        sums where DDP averages TRL's."""
        inner = self._prefixflow_model(self.accelerator.unwrap_model(model))
        if plans is None:
            plans = self._checked_plans(model, inputs)
        shards = self.accelerator.num_processes if self._prefixflow_sharded else 1
        if shards > 1:
            plans = [
                dataclasses.replace(
                    p,
                    loss_config=dataclasses.replace(
                        p.loss_config, group_weight=p.loss_config.group_weight / shards
                    ),
                )
                for p in plans
            ]
        options = {"layout": self.prefixflow_layout, "microbatch": self.prefixflow_microbatch, "loss": "grpo"}
        total, vision = 0.0, 0
        with self.compute_loss_context_manager(), self.accelerator.autocast(), self._gathered(inner):
            for plan in plans:
                stats = train_group(inner, plan.group, loss_config=plan.loss_config, **options)
                total += stats.loss * shards
                vision += stats.vision_tokens
        if not plans:  # every completion masked: TRL back-propagates a zero loss, i.e. zero gradients
            for p in inner.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        else:
            metrics = self._metrics["train"]
            metrics["prefixflow/group_size"].append(sum(p.group.n for p in plans) / len(plans))
            metrics["prefixflow/prefix_tokens_reused"].append(float(reused_tokens(plans)))
            metrics["prefixflow/trees"].append(float(sum(not hasattr(p.group, "prompt") for p in plans)))
            if self._is_vlm:  # patches the tower encoded (each distinct image once per micro-batch)
                metrics["prefixflow/vision_tokens"].append(float(vision))
        return torch.tensor(total, dtype=torch.float64, device=self.accelerator.device)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Sharded: every rank joins the gather of the full weights here, which the main process then writes
        (transformers < 5.24 calls ``_save`` on the main process only, so a gather there would hang)."""
        if not self._prefixflow_sharded:
            return super().save_model(output_dir, _internal_call)
        self._prefixflow_gathered = sharding.full_state_dict(self._prefixflow_model(self.model))
        try:
            return super().save_model(output_dir, _internal_call)
        finally:
            self._prefixflow_gathered = None

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if self._prefixflow_sharded and state_dict is None:
            state_dict = self._prefixflow_gathered
            if state_dict is None:
                raise RuntimeError("a sharded model's weights are gathered by save_model on every rank")
        super()._save(output_dir, state_dict=state_dict)

    def _gathered(self, inner: nn.Module):
        return sharding.gathered(inner) if self._prefixflow_sharded else contextlib.nullcontext()

    def _verified_update(self, model: nn.Module, inputs, plans) -> torch.Tensor:
        """TRL's plain path and PrefixFlow's on the same micro-batch, in fp32 when the weights are fp32; raise if
        their gradients differ beyond the tolerance, then run the real update (in the training precision)."""
        sharded = self._prefixflow_sharded
        if sharded:
            sharding.reshard(self._prefixflow_model(model))
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        saved = [p.grad for _, p in params]
        dtype = params[0][1].dtype
        with self._check_precision(model):
            for _, p in params:
                p.grad = None
            if sharded:  # both sides reduced alike: averaged over the processes, reduce-scattered once
                trl_side, scale = (
                    self._gathered(self._prefixflow_model(model)),
                    1.0 / self.accelerator.num_processes,
                )
            else:  # both sides this process's own micro-batch: DDP's reduction off for TRL's backward, none for ours
                trl_side, scale = _no_sync(model), 1.0
            with self.compute_loss_context_manager(), trl_side:
                want_loss = self.compute_loss(model, inputs)
                self.accelerator.backward(want_loss * scale)
            want_loss = float(want_loss.detach())
            want = [p.grad for _, p in params]
            for _, p in params:
                p.grad = None
            loss = self._local_update(model, inputs, plans)
            got = [p.grad for _, p in params]
        worst, where = sharding.worst_rel_diff(params, got, want, collective=sharded)
        loss_diff = abs(float(loss) - want_loss) / (abs(want_loss) or 1.0)
        tolerance = self.verify_tolerance
        if tolerance is None:
            tolerance = VERIFY_TOLERANCE.get(dtype, 5e-2) if dtype in (torch.float64, torch.float32) else 5e-2
        for _, p in params:
            p.grad = None
        loss = self._prefixflow_update(model, inputs, plans)  # the update itself, in the training precision
        for (_, p), s in zip(params, saved, strict=True):
            p.grad = p.grad if s is None else (s if p.grad is None else s + p.grad)
        # the update is the gradient (a loss near 0, zero-mean advantages, has no scale); NaN fails the check
        if not math.isfinite(worst) or not worst <= tolerance:
            raise RuntimeError(
                f"PrefixFlow's first update differs from TRL's: max relative gradient difference {worst:.3e} "
                f"(at {where}), loss difference {loss_diff:.3e}; tolerance {tolerance:.1e} ({dtype})"
            )
        self._prefixflow_verified = True
        self._metrics["train"]["prefixflow/verify_max_rel_diff"].append(worst)
        return loss

    @contextlib.contextmanager
    def _check_precision(self, model: nn.Module):
        """Both paths without autocast: accelerate's autocast forward wrapper and ``accelerator.autocast`` (which
        TRL's log-prob forward and PrefixFlow's update enter) swapped out for the check."""
        original = getattr(model, "_original_forward", None)
        wrapped = model.__dict__.get("forward")
        if original is not None and wrapped is not None:
            model.forward = original
        self.accelerator.autocast = lambda *args, **kwargs: contextlib.nullcontext()
        try:
            yield
        finally:
            del self.accelerator.autocast
            if original is not None and wrapped is not None:
                model.forward = wrapped


def _no_sync(model: nn.Module):
    return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()
