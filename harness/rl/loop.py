"""The closed GRPO loop of Claim 2: synchronous, colocated, seeded, one trainer per run.

One step, in order (each phase timed; the only difference between runs of two trainers is ``system``):

1. **generation**: the rollout model samples N responses per prompt with a KV cache (``sample_responses``),
   noise from a generator seeded by (run seed, step, prompt);
2. **reward**: the task checks each response; GRPO advantages are normalised within each group;
3. **evaluation**: the actor (and the frozen reference, when ``kl_coef > 0``) score the responses,
   full sequences, forward only: the old and reference log-probs;
4. **update**: ``actor_update`` = ``train_group(loss="grpo")`` per group, one AdamW step;
5. **sync**: the actor's fp32 master weights are copied into the rollout model (cast to its dtype): the
   colocated equivalent of verl's actor -> vLLM weight sync.

Prompts come from the task's stream ``data_seed``: the same prompts, in the same order, for every run.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

import prefixflow as pf
from harness.rl.io import (
    TraceError,
    load_optimizer,
    load_tensors,
    load_weights,
    optimizer_tensors,
    save_tensors,
    state_tensors,
)
from harness.rl.multiturn import MultiTurnTask
from harness.rl.ranks import Ranks
from harness.rl.spec import MULTITURN_FIELDS, RLSpec
from harness.rl.task import EOS, RetrievalTask
from harness.rl.trainers import trainer_inputs
from prefixflow.model.dtypes import DTYPES
from prefixflow.parallel import parallel_state
from prefixflow.rl import (
    actor_update,
    autocast_for,
    group_advantages,
    named_parameters,
    response_logprobs,
    sample_responses,
    sync_weights,
)

__all__ = ["RunPlan", "ClosedLoop", "build_model_for", "task_of", "mix_seed", "PHASES"]

PHASES = ("generation", "reward", "evaluation", "update", "sync")
TRAIN_PHASES = ("A", "B", "C", "full")  # train_group's phase_times: A/B/C (PrefixFlow) or full (baseline)


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers (stable across runs and platforms)."""
    digest = hashlib.sha256(",".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def task_of(spec: RLSpec) -> RetrievalTask | MultiTurnTask:
    """The spec's task: ``retrieval`` (``harness.rl.task``) or ``multiturn`` (``harness.rl.multiturn``)."""
    t = spec.task
    if t.kind == "multiturn":
        given = {f: getattr(t, f) for f in MULTITURN_FIELDS if getattr(t, f) is not None}
        return MultiTurnTask(value_len=t.value_len, n_keys=t.n_keys or 16, choices=t.choices, **given)
    return RetrievalTask.for_prefix_ratio(t.prefix_ratio, t.value_len, t.n_keys, t.choices)


def model_overrides(spec: RLSpec, task: RetrievalTask) -> dict[str, Any]:
    """The model's overrides; the vocabulary is the task's (rounded up to a multiple of ``parallel.tp``, which
    shards it) unless given."""
    overrides = dict(spec.model.overrides)
    tp = spec.parallel.tp
    vocab = overrides.setdefault("vocab_size", -(-task.vocab_size // tp) * tp)
    if vocab < task.vocab_size:
        raise ValueError(
            f"model.overrides.vocab_size={vocab} is smaller than the task's {task.vocab_size} tokens"
        )
    if vocab % tp:
        raise ValueError(
            f"model.overrides.vocab_size={vocab} must be a multiple of parallel.tp={tp} (TP shards the vocabulary)"
        )
    return overrides


def build_model_for(spec: RLSpec, task: RetrievalTask, dtype: torch.dtype, device: torch.device):
    """A PrefixFlow-wrapped model of the spec (random init from ``spec.seed``)."""
    model = pf.build_model(
        spec.model.name, dtype=dtype, seed=spec.seed, overrides=model_overrides(spec, task), device=device
    )
    return pf.apply_prefixflow(model, pf.PrefixFlowConfig(attention=spec.loop.attention))


@dataclass(frozen=True)
class RunPlan:
    """One closed-loop run. ``role``: ``compare`` (a trainer at the main seed), ``reference`` (the baseline at
    ``reference_seed``) or ``trace`` (a short baseline run that only exports a trace in another dtype)."""

    name: str
    system: str
    seed: int
    dtype: str
    steps: int
    role: str
    trace_steps: int = 0
    lr: float | None = None  # None: the loop's learning rate
    trace_name: str | None = None  # the trace folder this run exports to (with trace_steps)


def _tree_fields(trainer: str, groups: list, inputs: list, rollouts: list) -> dict[str, Any]:
    """Tokens over all paths, tokens the trainer's forward computes (the baseline: every path whole; the
    PrefixFlow trainers: each shared run once), the shared fraction ``1 - computed / path tokens``; for a
    multi-turn task also the share of turn-1 calls that named the asked key and field."""
    paths = sum(g.prompt_len * g.n + sum(g.response_lens) for g in groups)
    computed = paths
    if trainer != "baseline":
        computed = sum(
            x.unique_tokens if isinstance(x, pf.RolloutTree) else x.prompt_len + sum(x.response_lens)
            for x in inputs
        )
    out = {"path_tokens": paths, "computed_tokens": computed, "shared_fraction": 1 - computed / paths}
    calls = [ok for ro in rollouts for ok in getattr(ro, "call_ok", [])]
    if calls:
        out["call_ok_frac"] = sum(calls) / len(calls)
    return out


class _Clock:
    def __init__(self, device: torch.device) -> None:
        self.device, self.times = device, {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times[phase] = time.perf_counter() - start


def _rms(xs: list[torch.Tensor]) -> float:
    """Root mean square over all elements; a sharded (DTensor) tensor's sum is reduced over its mesh."""

    def sum_sq(x: torch.Tensor) -> float:
        s = x.double().pow(2).sum()
        return float(s.full_tensor() if isinstance(s, DTensor) else s)

    total = sum(sum_sq(x) for x in xs)
    return (total / max(1, sum(x.numel() for x in xs))) ** 0.5


class ClosedLoop:
    """The models, optimizer and step counter of one run; :meth:`step` runs one GRPO step."""

    def __init__(
        self,
        spec: RLSpec,
        task: RetrievalTask | MultiTurnTask,
        plan: RunPlan,
        init: dict[str, torch.Tensor],
        device,
        ranks: Ranks | None = None,
    ) -> None:
        self.spec, self.task, self.plan, self.device = spec, task, plan, torch.device(device)
        self.ranks = ranks or Ranks.single()
        compute = DTYPES[plan.dtype]
        self.compute_dtype = compute if compute != torch.float32 else None
        actor = build_model_for(spec, task, torch.float32, self.device)
        load_weights(actor, init, "warm start")
        self.rollout = build_model_for(spec, task, compute, self.device)
        sync_weights(actor, self.rollout)
        self.ref = None
        if spec.loop.kl_coef > 0:
            ref = build_model_for(spec, task, compute, self.device)
            sync_weights(actor, ref)
            ref.requires_grad_(False)
            self.ref = self.ranks.parallelize(ref)
        self.rollout.requires_grad_(False)
        self.actor = self.ranks.parallelize(actor)  # loaded first: every rank holds the same whole weights
        loop = spec.loop
        self.optimizer = torch.optim.AdamW(
            self.actor.parameters(),
            lr=loop.lr,
            betas=loop.betas,
            eps=loop.eps,
            weight_decay=loop.weight_decay,
            fused=loop.fused_adamw,
        )
        # the warm start, laid out like the actor (a sharded copy on many ranks): each step's drift from it
        self.init = {k: p.detach().clone() for k, p in named_parameters(self.actor).items()}
        state = parallel_state(self.actor)
        self.actor_layout = state.dims.label if state is not None else "single"
        self.step_done = 0

    def weights(self) -> dict[str, torch.Tensor]:
        """The actor's weights, whole (on many ranks a gather: every rank calls it)."""
        return state_tensors(self.actor)

    # ---- one step -------------------------------------------------------------------------------------
    def prompts(self, step: int) -> list[tuple[torch.Tensor, Any]]:
        """(prompt, what its reward checks: the answer, or a multi-turn episode) of each of the step's prompts."""
        g = self.spec.loop.prompts_per_step
        examples = [self.task.example(self.spec.data_seed, (step - 1) * g + i) for i in range(g)]
        if isinstance(self.task, MultiTurnTask):
            return [(ep.prompt, ep) for ep in examples]
        return examples

    def _rewards(self, rollout, answer) -> torch.Tensor:
        if isinstance(self.task, MultiTurnTask):
            return torch.tensor([self.task.reward(a, answer) for a in rollout.answers], dtype=torch.float64)
        return torch.tensor(
            [self.task.reward(r.cpu(), answer) for r in rollout.responses], dtype=torch.float64
        )

    def step(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Run the next step; returns (record fields, trainer inputs of the step for a trace)."""
        loop, step = self.spec.loop, self.step_done + 1
        clock = _Clock(self.device)
        prompts = self.prompts(step)
        with clock("generation"):
            episodes = [p[1] if isinstance(self.task, MultiTurnTask) else None for p in prompts]
            rollouts = self.ranks.share(
                lambda i: self._sample(step, i, prompts[i][0], episodes[i]), len(prompts)
            )
        with clock("reward"):
            rewards = [self._rewards(ro, answer) for ro, (_, answer) in zip(rollouts, prompts, strict=True)]
            advantages = [group_advantages(r) for r in rewards]
        with clock("evaluation"):
            old, ref = [], []
            with autocast_for(self.device, self.compute_dtype):
                for ro, (prompt, _) in zip(rollouts, prompts, strict=True):
                    old.append(
                        response_logprobs(self.actor, prompt, ro.responses, microbatch=loop.microbatch)
                    )
                    if self.ref is not None:
                        ref.append(
                            response_logprobs(self.ref, prompt, ro.responses, microbatch=loop.microbatch)
                        )
        groups = [
            pf.RolloutGroup(
                prompt, ro.responses, adv, old[i], ref[i] if self.ref is not None else None,
                loss_masks=getattr(ro, "loss_masks", None),
            )
            for i, ((prompt, _), ro, adv) in enumerate(zip(prompts, rollouts, advantages, strict=True))
        ]  # fmt: skip
        lr = loop.lr_at(step, self.plan.lr)
        with clock("update"):
            # the tree trainers build their trees here, inside the timed update
            system, inputs = trainer_inputs(self.plan.system, groups)
            stats = actor_update(
                self.actor,
                inputs,
                self.optimizer,
                system=system,
                lr=lr,
                layout=loop.layout,
                microbatch=loop.microbatch,
                loss_config=loop.loss_config(),
                max_grad_norm=loop.max_grad_norm,
                compute_dtype=self.compute_dtype,
            )
        with clock("sync"):
            synced = sync_weights(self.actor, self.rollout)
        self.step_done = step
        # the same keys on every rank, in one order (a rank may have trained no group of some phase)
        own = {**clock.times, **{k: stats.phase_times.get(k, 0.0) for k in TRAIN_PHASES}}
        times = self.ranks.slowest({**own, "optimizer": stats.optimizer_s})
        lens = [n for g in groups for n in g.response_lens]
        all_rewards = torch.cat(rewards)
        record = {
            "step": step,
            **{f"{phase}_s": times[phase] for phase in PHASES},
            "step_s": sum(times[phase] for phase in PHASES),
            "update_train_s": sum(times[k] for k in TRAIN_PHASES),
            "update_optimizer_s": times["optimizer"],
            **{f"phase_{k.lower()}_s": times[k] for k in stats.phase_times},
            "reward_mean": float(all_rewards.mean()),
            "reward_std": float(all_rewards.std()) if all_rewards.numel() > 1 else 0.0,
            "exact_match": float((all_rewards == 1.0).double().mean()),
            "loss": stats.loss,
            "grad_norm": stats.grad_norm,
            "lr": lr,
            "prompt_tokens": sum(g.prompt_len for g in groups),
            "response_tokens": sum(lens),
            "response_len_mean": sum(lens) / len(lens),
            "padded_suffix_len_mean": sum(max(g.response_lens) for g in groups) / len(groups),
            "truncated_frac": sum(t for ro in rollouts for t in ro.truncated) / len(lens),
            "trunk_tokens": stats.trunk_tokens,
            **_tree_fields(self.plan.system, groups, inputs, rollouts),
            "sync_bytes": synced,
            "actor_layout": self.actor_layout,
            "drift_rms": _rms([p.detach() - self.init[k] for k, p in named_parameters(self.actor).items()]),
            "weight_rms": _rms([p.detach() for p in self.actor.parameters()]),
        }
        trace = {"lr": lr, "groups": groups}
        return record, trace

    def _sample(self, step: int, i: int, prompt: torch.Tensor, episode=None):
        """Prompt ``i``'s N responses (a multi-turn ``episode``: its ``calls x N / calls`` paths), noise seeded
        by (run seed, step, prompt): the same on any rank."""
        loop = self.spec.loop
        gen = torch.Generator(self.device).manual_seed(mix_seed(self.plan.seed, step, i))
        if episode is not None:
            return self.task.rollout(
                self.rollout, episode, loop.n // self.task.calls, max_new_tokens=loop.max_new_tokens,
                temperature=loop.temperature, generator=gen,
            )  # fmt: skip
        return sample_responses(
            self.rollout,
            prompt,
            loop.n,
            max_new_tokens=loop.max_new_tokens,
            eos_id=EOS,
            temperature=loop.temperature,
            generator=gen,
        )

    # ---- state ----------------------------------------------------------------------------------------
    def save_resume(self, path: Path, identity: str, root: Path | None = None) -> None:
        tensors = {**state_tensors(self.actor, "w."), **optimizer_tensors(self.actor, self.optimizer)}
        save_tensors(path, tensors, {"step": str(self.step_done), "identity": identity}, root)

    def load_resume(self, path: Path, identity: str) -> None:
        tensors, meta = load_tensors(path)
        if meta.get("identity") != identity:
            raise TraceError(f"{path}: written by another configuration (identity {meta.get('identity')!r})")
        try:
            step = int(meta["step"])
        except (KeyError, ValueError):
            raise TraceError(f"{path}: metadata lacks a valid 'step'") from None
        load_weights(self.actor, tensors, path, prefix="w.")
        load_optimizer(self.actor, self.optimizer, tensors, path)
        sync_weights(self.actor, self.rollout)
        self.step_done = step
