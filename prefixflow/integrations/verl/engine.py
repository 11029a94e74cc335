"""``PrefixFlowFSDPEngine``: verl 0.9.x's ``FSDPEngineWithLMHead`` whose training micro-batches run PrefixFlow.

Only ``forward_backward_batch(data, loss_function, forward_only=False)`` changes. verl's ``train_batch`` still
zeroes gradients, calls it, clips and steps; log-prob inference (``forward_only=True``) is verl's own path. For
each verl micro-batch (``prepare_micro_batches``, as verl splits it) the rows are grouped by ``uid`` and each group
is one :func:`prefixflow.train_group` (prompt K/V computed once) under the loss of :mod:`.plan`. The metrics and
the reported loss are verl's own ``ppo_loss`` evaluated, without gradient, on the log-probs PrefixFlow's LM head
produced (read by a forward hook), so ``train_batch`` returns what verl's does.

FSDP2 (``strategy=fsdp2``): for the mini-batch every FSDP unit is gathered once, gradient sync is off, and every
unit reduce-scatters once at the end with verl's own reduction settings; PrefixFlow's phases call parts of the
model (embedding, blocks, LM head) outside FSDP's root forward, which this makes safe.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id, get_device_name
from verl.workers.engine import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches
from verl.workers.utils.losses import ppo_loss

from ... import apply_prefixflow, score_group, train_group
from ...hooks import ScheduleHooks, add_hooks, remove_hooks
from ...loss import token_logprobs
from ...parallel import fsdp as pf_fsdp
from ...parallel import fsdp_compat
from ...parallel.cp import apply_cp
from ...schedule.driver import check_group
from .. import hf  # noqa: F401  (registers the HF adapter and attention)
from .plan import (
    GroupPlan,
    actor_loss_config,
    check_batch,
    loss_callable_config,
    phase_b_budget,
    plan_micro_batch,
    score_plans,
)

__all__ = ["VENDOR", "PrefixFlowFSDPEngine"]

logger = logging.getLogger(__name__)

#: ``VERL_ENGINE_VENDOR`` value that selects this engine (verl's own engine-registry override).
VENDOR = "prefixflow"


@EngineRegistry.register(
    model_type="language_model", backend=["fsdp", "fsdp2"], device=["cuda", "npu"], vendor=VENDOR
)
class PrefixFlowFSDPEngine(FSDPEngineWithLMHead):
    """verl's FSDP engine with PrefixFlow's actor update: each uid group of the rank's mini-batch is one
    ``train_group``, packed under ``use_remove_padding``, its Phase-B microbatches within verl's micro-batch size
    or (``use_dynamic_bsz``) its token budget."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        bad = []
        if engine_config.strategy != "fsdp2":
            bad.append(
                f"actor.strategy={engine_config.strategy!r} (FSDP1; set actor_rollout_ref.actor.strategy=fsdp2)"
            )
        if model_config.use_fused_kernels or getattr(engine_config, "use_fused_kernels", False):
            bad.append("use_fused_kernels=True (set actor_rollout_ref.model.use_fused_kernels=False)")
        if model_config.lora_rank > 0:
            bad.append(f"lora_rank={model_config.lora_rank} (LoRA; set actor_rollout_ref.model.lora_rank=0)")
        if engine_config.offload_policy:
            bad.append("offload_policy=True (FSDP2 CPU offload; set actor.fsdp_config.offload_policy=False)")
        if bad:
            raise ValueError(f"PrefixFlow's verl engine does not support: {'; '.join(bad)}")
        attn = getattr(model_config.hf_config, "_attn_implementation", None)
        if attn not in ("sdpa", None):
            # PrefixFlow's attention (over transformers' sdpa) replaces the model's in every forward of this
            # engine; switching before the weights load keeps a missing flash-attn from stopping initialize().
            logger.warning(
                "PrefixFlow's verl engine: attn_implementation=%r replaced by PrefixFlow's attention (transformers' "
                "sdpa outside PrefixFlow's phases)",
                attn,
            )
            model_config.hf_config._attn_implementation = "sdpa"
        if getattr(engine_config, "use_torch_compile", False):
            logger.warning(
                "PrefixFlow's verl engine: use_torch_compile=True runs eager: verl's FSDP engine compiles only "
                "its entropy function (calculate_entropy, which PrefixFlow refuses), and PrefixFlow's phases "
                "call verl's FSDP2 blocks outside their root forward"
            )
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)
        self._prefixflow_applied = False

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        if forward_only:
            if self.ulysses_sequence_parallel_size > 1:
                return self._score_batch(data, loss_function)
            return super().forward_backward_batch(data, loss_function, forward_only=True)
        actor = loss_callable_config(loss_function)
        base = actor_loss_config(actor)
        refused = ("use_fused_kernels", "calculate_entropy", "return_model_output")
        for key in refused:
            if tu.get_non_tensor_data(data=data, key=key, default=False):
                raise ValueError(f"PrefixFlow's verl engine does not support {key}=True in the batch")
        if "rollout_is_weights" in data.keys():
            raise ValueError(
                "PrefixFlow's verl engine does not support rollout_is_weights (rollout correction)"
            )
        check_batch(data, kl=base["kl_coef"] > 0)
        model = self._applied()
        sp_size = self.ulysses_sequence_parallel_size

        dp_size = self.get_data_parallel_size()
        micro_batches, indices = self._micro_batches(data)
        micro_rows = _micro_batch_rows(micro_batches, indices)
        data = data.to(get_device_id())
        micro_batches = [mb.to(get_device_id()) for mb in micro_batches]
        layout = _layout(data)
        budget = phase_b_budget(data, sp_size)

        def plan(td):
            return plan_micro_batch(
                td, dict(base), dp_size=dp_size, sp_size=sp_size, batch_tokens=td["batch_num_tokens"],
                global_batch_size=td["global_batch_size"], loss_scale_factor=actor.loss_scale_factor,
                token_budget=budget,
            )  # fmt: skip

        if data["global_batch_size"] is None:
            # one rank, no global batch size: verl normalises each micro-batch by its own rows
            plans = [
                p.on_rows(rows) for mb, rows in zip(micro_batches, micro_rows, strict=True) for p in plan(mb)
            ]
        else:
            plans = plan(data)  # a uid split over verl's micro-batches trains as one group on this rank
        options = {"layout": layout, "loss": "grpo"}
        for p in plans:  # every group is valid before the first one changes a gradient
            check_group(
                model, p.group, system=p.system, loss_config=p.loss_config, microbatch=p.microbatch, **options
            )

        tap = _LogprobTap(model)
        autocast = self._autocast()
        # the log-probs in the model's precision (fp64 weights: fp64), read back for verl's metrics
        logp = torch.zeros(data["responses"].shape, dtype=_precision(model), device=data["responses"].device)
        with _gathered(model), tap.installed(), autocast:
            for p in plans:
                tap.plan, tap.out = p, logp
                train_group(
                    model,
                    p.group,
                    system=p.system,
                    loss_config=p.loss_config,
                    microbatch=p.microbatch,
                    **options,
                )
        if sp_size > 1:  # each SP rank read the log-probs of its own tokens (zeros elsewhere)
            torch.distributed.all_reduce(logp, group=self.ulysses_parallel_group)
        output_lst = [
            _verl_outputs(actor, mb, logp[rows]) for mb, rows in zip(micro_batches, micro_rows, strict=True)
        ]
        for p in model.parameters():  # verl's backward reaches every parameter, also through a zero loss
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        return postprocess_batch_func(output_lst=output_lst, indices=indices, data=data)

    def _applied(self):
        """The module, PrefixFlow applied once (and, under Ulysses, its context parallelism over verl's SP group:
        each SP rank trains its head-tail share of every group's tokens)."""
        if not self._prefixflow_applied:
            apply_prefixflow(self.module)
            if self.ulysses_sequence_parallel_size > 1:
                apply_cp(self.module, self.ulysses_parallel_group, reduce_grads=False)
            self._prefixflow_applied = True
        return self.module

    def _score_batch(self, data, loss_function):
        """Forward-only under Ulysses. verl's own forward slices each packed micro-batch over the SP ranks and
        needs its flash-attention forward for the all-to-all; this engine runs sdpa, so the log-probs come from
        PrefixFlow's phases (:func:`prefixflow.score_group`, each prompt once): every SP rank scores its DP
        rank's rows whole. Prompt positions of the returned ``log_probs`` hold 0 (verl reads the responses)."""
        if tu.get_non_tensor_data(data=data, key="use_fused_kernels", default=False):
            raise ValueError("PrefixFlow's verl engine does not support use_fused_kernels=True in the batch")
        model = self._applied()
        entropy = bool(tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False))
        group = self.get_data_parallel_group()
        micro_batches, indices = self._micro_batches(data)
        layout, precision = _layout(data), _precision(model)
        tap = _LogprobTap(model)
        output_lst = []
        with _gathered(model, reduce=False), tap.reading(), torch.no_grad(), self._autocast():
            for mb in micro_batches:
                mb = mb.to(get_device_id())
                shape = mb["responses"].shape
                tap.out = torch.zeros(shape, dtype=precision, device=mb["responses"].device)
                tap.entropy = torch.zeros_like(tap.out) if entropy else None
                for plan in score_plans(mb):
                    tap.plan = plan
                    score_group(
                        model,
                        plan.group,
                        layout=layout,
                        temperature=plan.loss_config.temperature,
                        hooks=[tap],
                    )
                model_output = {"log_probs": _response_nested(mb, tap.out)}
                if entropy:
                    model_output["entropy"] = _response_nested(mb, tap.entropy)
                loss, metrics = 1.0, {}
                if loss_function is not None:
                    value, metrics = loss_function(model_output=model_output, data=mb, dp_group=group)
                    loss = float(value)
                output_lst.append({"model_output": model_output, "loss": loss, "metrics": metrics})
        return postprocess_batch_func(output_lst=output_lst, indices=indices, data=data)

    def _micro_batches(self, data):
        """What verl's ``forward_backward_batch`` computes before splitting (the global loss normalisation, put
        on ``data``), and its split into micro-batches: ``(micro_batches, indices)``."""
        tu.assign_non_tensor(data, sp_size=self.ulysses_sequence_parallel_size)
        batch_tokens = data["loss_mask"].sum().to(torch.float64)
        group = self.get_data_parallel_group()
        torch.distributed.all_reduce(batch_tokens, op=torch.distributed.ReduceOp.SUM, group=group)
        tu.assign_non_tensor(
            data, batch_num_tokens=batch_tokens.item(), dp_size=self.get_data_parallel_size()
        )
        return prepare_micro_batches(data=data, dp_group=group, same_micro_num_in_dp=True)

    def _autocast(self):
        dtype = getattr(self, "_autocast_dtype", torch.bfloat16)  # verl's forward_step autocasts the same way
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=get_device_name(), dtype=dtype)


def _layout(data) -> str:
    """PrefixFlow's layout for verl's batch: remove-padding inputs train packed."""
    return (
        "packed" if tu.get_non_tensor_data(data=data, key="use_remove_padding", default=False) else "padded"
    )


def _precision(model) -> torch.dtype:
    """The dtype log-probs are read back in: the model's, at least fp32."""
    return torch.promote_types(torch.float32, next(model.parameters()).dtype)


def _response_nested(micro_batch, values: torch.Tensor) -> torch.Tensor:
    """verl's no-padding model output for a micro-batch: one row of prompt + response length per sample, the
    response values one position to the left (where verl's shifted log-probs sit), 0 at the prompt."""
    p = micro_batch["prompts"].shape[1]
    attention = micro_batch["attention_mask"]
    flat = []
    for r in range(attention.shape[0]):
        plen, n = int(attention[r, :p].sum()), int(attention[r, p:].sum())
        row = torch.zeros(plen + n, dtype=values.dtype, device=values.device)
        row[plen - 1 : plen - 1 + n] = values[r, :n]
        flat.append(row)
    return torch.nested.as_nested_tensor(flat, layout=torch.jagged)


def _micro_batch_rows(micro_batches, indices) -> list[torch.Tensor]:
    """The rows of the rank's batch that each verl micro-batch holds: verl's balancing indices
    (``use_dynamic_bsz``) or consecutive chunks."""
    if indices is not None:
        return [torch.as_tensor(list(i), dtype=torch.long) for i in indices]
    out, start = [], 0
    for mb in micro_batches:
        out.append(torch.arange(start, start + len(mb)))
        start += len(mb)
    return out


def _verl_outputs(actor, micro_batch, logp: torch.Tensor) -> dict:
    """verl's ``forward_step`` output for a micro-batch: ``ppo_loss`` on PrefixFlow's log-probs, no gradient."""
    nested = _response_nested(micro_batch, logp)
    with torch.no_grad():
        loss, metrics = ppo_loss(actor, model_output={"log_probs": nested}, data=micro_batch)
    return {"loss": float(loss), "metrics": metrics}


class _LogprobTap(ScheduleHooks):
    """Reads the log-probs (and, with ``entropy`` set, the entropies) PrefixFlow's LM head computes for each
    suffix microbatch (detached) into the verl micro-batch's ``[rows, response]`` tensors, for verl's metrics or
    forward-only output. Changes no number."""

    def __init__(self, model) -> None:
        self.model = model
        self.plan: GroupPlan | None = None
        self.out: torch.Tensor | None = None
        self.entropy: torch.Tensor | None = None
        self._mb = None

    @contextlib.contextmanager
    def reading(self):
        """The LM-head hook only (a forward-only call passes the tap as its schedule hook)."""
        handle = self.model.get_output_embeddings().register_forward_hook(self._read)
        try:
            yield
        finally:
            handle.remove()

    @contextlib.contextmanager
    def installed(self):
        add_hooks(self.model, self)
        try:
            with self.reading():
                yield
        finally:
            remove_hooks(self.model, self)

    @contextlib.contextmanager
    def microbatch(self, mb):
        self._mb = mb
        try:
            yield
        finally:
            self._mb = None

    def _read(self, module, args, output) -> None:
        mb, plan = self._mb, self.plan
        if mb is None or plan is None:
            return
        temperature = plan.loss_config.temperature
        logp = token_logprobs(output.detach(), mb.targets, temperature)
        rows = torch.tensor(plan.rows, device=logp.device)[mb.response_ids]
        self.out[rows, mb.token_ids] = logp.to(self.out.dtype)
        if self.entropy is not None:
            logits = output.detach().to(torch.promote_types(output.dtype, torch.float32)) / temperature
            self.entropy[rows, mb.token_ids] = (
                torch.distributions.Categorical(logits=logits).entropy().to(self.entropy.dtype)
            )

    @contextlib.contextmanager
    def phase(self, name: str):
        yield
        if name == "A":  # Phase A stops inside the last block: close that unit's FSDP forward
            pf_fsdp._close_interrupted_forwards(self.model)


@contextlib.contextmanager
def _gathered(model, reduce: bool = True):
    """Every FSDP2 unit gathered for the mini-batch, gradient sync off, one reduce-scatter per unit at the end
    (verl's reduction settings; ``reduce=False``: none, a forward-only call). On an error, FSDP is reset and the
    unreduced gradients are dropped."""
    pf_fsdp._root_state(model)._lazy_init()
    groups = list(pf_fsdp._groups(model))
    saved = [
        (g, g.post_forward_mesh_info, g.reshard_after_backward, g.reduce_grads, g.all_reduce_grads)
        for g in groups
    ]
    for g in groups:
        g.post_forward_mesh_info = None  # no reshard after forward
        g.reshard_after_backward = False
        g.unshard()
        g.wait_for_unshard()
    pf_fsdp._set_sync(model, False)
    try:
        yield
        if reduce:
            pf_fsdp.reduce_gradients(model)
    except BaseException:
        pf_fsdp.discard(model)
        raise
    finally:
        for g, mesh_info, after_backward, reduce_grads, all_reduce in saved:
            g.post_forward_mesh_info = mesh_info
            g.reshard_after_backward = after_backward
            g.reduce_grads, g.all_reduce_grads = reduce_grads, all_reduce
            g._training_state = TrainingState.IDLE
            g.reshard()
        if not reduce:  # no backward follows: clear the forwards' bookkeeping as FSDP's own reset does
            fsdp_compat.reset_iter_state(model, pf_fsdp._root_state(model))
