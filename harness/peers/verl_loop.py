"""A one-process GRPO driver built from verl 0.9's own pieces, run once with verl's ``FSDPEngineWithLMHead``
and once with ``PrefixFlowFSDPEngine`` in lockstep (same seed: the same generations at step 1).

What comes from verl (not patched): ``DataProto`` and its ``repeat``/``union``; prompt tokenisation
(``tokenize_and_postprocess_data``, ``compute_position_id_with_mask``); generation by ``HFRollout``'s own
``_generate_minibatch`` on the actor's module (``HFRollout`` cannot be constructed in 0.9.1: it is abstract, see
docs/verl.md); GRPO's ``compute_grpo_outcome_advantage`` from ``core_algos`` (what ``ray_trainer.compute_advantage``
calls; ``ray_trainer`` itself imports ``cachetools``, which verl does not declare); old and
reference log-probs through ``engine.infer_batch`` (the engines' forward-only path); the update through
``engine.train_batch`` with ``ppo_loss``, as ``TrainingWorker.train_batch`` calls it; timing by verl's
``marked_timer`` under ``ray_trainer``'s keys (``gen``, ``reward``, ``old_log_prob``, ``ref``, ``adv``,
``update_actor``, ``step``). Each engine writes ``<out>/<engine>.jsonl`` (one line per step); the weight
divergence between the runs goes to ``<out>/divergence.jsonl``; ``harness.rl.verl_driver`` turns the
logs into pf-bench records and is the command that runs both.
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from harness.peers.verl_platform import init_one_rank, select_cpu_platform
from harness.peers.verl_rag import make_tokenizer, rule_reward, write_dataset

__all__ = ["DriverConfig", "run_driver"]

ENGINES = {"verl": None, "prefixflow": "prefixflow"}  # log name -> VERL_ENGINE_VENDOR
TIMING_KEYS = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "step")


class DriverConfig(SimpleNamespace):
    """The run's settings (defaults: the committed run). ``mini_batches``: optimizer steps per GRPO step."""

    def __init__(self, **kw):
        base = dict(
            steps=20, prompts_per_step=2, n=16, facts=48, response_length=16, hidden=64, layers=2,
            micro_batch=8, mini_batches=1, lr=1e-3, kl_coef=0.001, temperature=1.0, seed=0, threads=1,
        )  # fmt: skip
        unknown = set(kw) - set(base)
        if unknown:
            raise ValueError(f"unknown driver setting(s) {sorted(unknown)}; known: {sorted(base)}")
        base.update(kw)
        for key in ("steps", "prompts_per_step", "n", "facts", "response_length", "micro_batch"):
            if int(base[key]) < 1:
                raise ValueError(f"{key}={base[key]}: must be at least 1")
        if base["prompts_per_step"] % base["mini_batches"]:
            raise ValueError(f"mini_batches={base['mini_batches']}: must divide prompts_per_step")
        super().__init__(**base)


def save_model(path: Path, tokenizer, cfg: DriverConfig) -> None:
    """A tiny Qwen3 from a config (random weights, seed ``cfg.seed``), saved with the tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3", hidden_size=cfg.hidden, intermediate_size=2 * cfg.hidden, num_hidden_layers=cfg.layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=cfg.hidden // 4, vocab_size=len(tokenizer),
        max_position_embeddings=1024, attention_dropout=0.0, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def build_engine(model_dir: Path, vendor: str | None, cfg: DriverConfig):
    """verl's engine or PrefixFlow's as verl's ``TrainingWorker`` builds it (``EngineRegistry.new``, then
    ``initialize``): FSDP2, remove-padding (verl's default), fp32, AdamW at ``cfg.lr``, gradient clip 1."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    previous = os.environ.pop("VERL_ENGINE_VENDOR", None)
    try:
        if vendor:
            os.environ["VERL_ENGINE_VENDOR"] = vendor
        engine = EngineRegistry.new(
            model_type="language_model",
            backend="fsdp2",
            model_config=HFModelConfig(
                path=str(model_dir),
                load_tokenizer=False,
                override_config={"attn_implementation": "sdpa"},
                use_remove_padding=True,
            ),
            engine_config=FSDPEngineConfig(
                strategy="fsdp2",
                model_dtype="fp32",
                use_torch_compile=False,
                use_remove_padding=True,
                use_dynamic_bsz=False,
                mixed_precision=fp32,
            ),  # fmt: skip
            optimizer_config=FSDPOptimizerConfig(lr=cfg.lr, clip_grad=1.0),
            checkpoint_config=CheckpointConfig(),
        )
    finally:
        os.environ.pop("VERL_ENGINE_VENDOR", None)
        if previous is not None:
            os.environ["VERL_ENGINE_VENDOR"] = previous
    engine.initialize()
    return engine


def load_prompts(path: Path, tokenizer, max_prompt_length: int):
    """The parquet rows, tokenised as verl's trainer sees them: the chat template, left padding to
    ``max_prompt_length``, position ids from the mask; ground truths and data sources beside them."""
    import pandas as pd
    import verl.utils.torch_functional as verl_F
    from verl.utils.model import compute_position_id_with_mask

    df = pd.read_parquet(path)
    ids, masks = [], []
    for messages in df["prompt"]:
        text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        i, m = verl_F.tokenize_and_postprocess_data(
            prompt=text, tokenizer=tokenizer, max_length=max_prompt_length,
            pad_token_id=tokenizer.pad_token_id, left_pad=True, truncation="error",
        )  # fmt: skip
        ids.append(i[0])
        masks.append(m[0])
    input_ids, attention = torch.stack(ids), torch.stack(masks)
    truths = np.array([r["ground_truth"] for r in df["reward_model"]], dtype=object)
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "position_ids": compute_position_id_with_mask(attention),
        "ground_truth": truths,
        "data_source": df["data_source"].to_numpy(dtype=object),
    }


class Run:
    """One engine's GRPO loop: actor engine (whose module also generates, as verl's hybrid engine does) and
    a frozen reference engine of the same vendor."""

    def __init__(self, name: str, model_dir: Path, tokenizer, cfg: DriverConfig, log_path: Path) -> None:
        from omegaconf import OmegaConf
        from verl.workers.config import FSDPActorConfig

        self.name, self.cfg, self.tokenizer = name, cfg, tokenizer
        self.actor = build_engine(model_dir, ENGINES[name], cfg)
        self.ref = build_engine(model_dir, ENGINES[name], cfg)
        rollout = OmegaConf.create(
            dict(
                do_sample=True, temperature=cfg.temperature, response_length=cfg.response_length, top_p=1.0,
                top_k=0, micro_batch_size=cfg.prompts_per_step * cfg.n,
                val_kwargs=dict(top_k=0, top_p=1.0, temperature=0.0),
            )
        )  # fmt: skip
        self.rollout = SimpleNamespace(config=rollout, module=self.actor.module)  # HFRollout's two fields
        self.loss_config = FSDPActorConfig(
            strategy="fsdp2", ppo_mini_batch_size=cfg.prompts_per_step // cfg.mini_batches,
            ppo_micro_batch_size_per_gpu=cfg.micro_batch, use_dynamic_bsz=False, rollout_n=cfg.n,
            loss_agg_mode="token-mean", use_kl_loss=True, kl_loss_coef=cfg.kl_coef, kl_loss_type="low_var_kl",
        )  # fmt: skip
        self.log = log_path.open("w")

    def weights(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in self.actor.module.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = full.detach().double().clone()
        return out

    def _infer(self, batch):
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding

        td = left_right_2_no_padding(batch.to_tensordict())
        tu.assign_non_tensor(
            td, calculate_entropy=False, compute_loss=False, use_remove_padding=True, use_dynamic_bsz=False,
            max_token_len_per_gpu=None, micro_batch_size_per_gpu=self.cfg.micro_batch, use_fused_kernels=False,
            global_token_num=None,
        )  # fmt: skip
        return td

    def log_probs(self, engine, batch) -> torch.Tensor:
        """Forward-only log-probs of the responses (verl's ``_compute_old_log_prob`` steps 1-4)."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        td = self._infer(batch)
        with engine.eval_mode():
            out = engine.infer_batch(td)
        return no_padding_2_padding(tu.get(out["model_output"], "log_probs"), td).float()

    def update(self, batch) -> dict:
        """verl's ``update_actor``: mini-batches of ``ppo_mini_batch_size * n`` rows, one ``train_batch`` each,
        then the lr scheduler step. Returns the sum of the reported losses and the last grad norm."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.losses import ppo_loss
        from verl.workers.utils.padding import left_right_2_no_padding

        rows = self.loss_config.ppo_mini_batch_size * self.cfg.n
        loss, grad_norm = 0.0, float("nan")
        with self.actor.train_mode():
            for start in range(0, len(batch), rows):
                td = left_right_2_no_padding(batch[start : start + rows].to_tensordict())
                tu.assign_non_tensor(
                    td, calculate_entropy=False, global_batch_size=rows, use_remove_padding=True,
                    use_dynamic_bsz=False, max_token_len_per_gpu=None, micro_batch_size_per_gpu=self.cfg.micro_batch,
                    use_fused_kernels=False, global_token_num=None,
                )  # fmt: skip
                out = self.actor.train_batch(td, loss_function=partial(ppo_loss, config=self.loss_config))
                losses = out["loss"] if isinstance(out["loss"], list) else [out["loss"]]
                loss += float(sum(float(x) for x in losses))
                grad_norm = float(np.mean(_scalar(out["metrics"].get("actor/grad_norm", np.nan))))
            self.actor.lr_scheduler_step()
        return {"loss": loss, "grad_norm": grad_norm}

    def step(self, step: int, prompts: dict) -> dict:
        """One GRPO step as ``RayPPOTrainer.fit`` runs it."""
        from verl import DataProto
        from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
        from verl.utils.profiler.performance import marked_timer
        from verl.workers.rollout.hf_rollout import HFRollout

        cfg, tok = self.cfg, self.tokenizer
        g = cfg.prompts_per_step
        pick = [(step - 1) * g + i for i in range(g)]
        pick = [i % len(prompts["input_ids"]) for i in pick]
        batch = DataProto.from_dict(
            tensors={k: prompts[k][pick] for k in ("input_ids", "attention_mask", "position_ids")},
            non_tensors={
                "uid": np.array([str(uuid.UUID(int=step * 1000 + i)) for i in range(g)], dtype=object),
                "ground_truth": prompts["ground_truth"][pick],
            },
        )
        timing: dict[str, float] = {}
        with marked_timer("step", timing):
            gen = batch.pop(batch_keys=["input_ids", "attention_mask", "position_ids"])
            gen = gen.repeat(repeat_times=cfg.n, interleave=True)
            gen.meta_info = {
                "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "do_sample": True,
                "temperature": cfg.temperature, "response_length": cfg.response_length,
            }  # fmt: skip
            with marked_timer("gen", timing):
                torch.manual_seed(cfg.seed * 100_003 + step)  # same seed in both runs: same step-1 samples
                out = HFRollout._generate_minibatch(self.rollout, gen)
            batch = batch.repeat(repeat_times=cfg.n, interleave=True).union(out)
            # ray_trainer.compute_response_mask (that module needs cachetools, which verl does not declare)
            batch.batch["response_mask"] = batch.batch["attention_mask"][:, -cfg.response_length :]
            batch.meta_info["temperature"] = cfg.temperature
            with marked_timer("reward", timing):
                scores = self.rewards(batch)
                level = torch.zeros_like(batch.batch["response_mask"], dtype=torch.float32)
                last = batch.batch["response_mask"].sum(-1).clamp(min=1) - 1
                level[torch.arange(len(level)), last] = scores
                batch.batch["token_level_scores"] = level
                batch.batch["token_level_rewards"] = level
            with marked_timer("old_log_prob", timing):
                batch.batch["old_log_probs"] = self.log_probs(self.actor, batch)
            with marked_timer("ref", timing):
                batch.batch["ref_log_prob"] = self.log_probs(self.ref, batch)
            with marked_timer("adv", timing):
                adv, ret = compute_grpo_outcome_advantage(  # what ray_trainer.compute_advantage calls for GRPO
                    token_level_rewards=level, response_mask=batch.batch["response_mask"],
                    index=batch.non_tensor_batch["uid"], norm_adv_by_std_in_grpo=True,
                )  # fmt: skip
                batch.batch["advantages"], batch.batch["returns"] = adv, ret
            with marked_timer("update_actor", timing):
                upd = self.update(batch)
        mask = batch.batch["response_mask"]
        record = {
            "step": step,
            "engine": self.name,
            **{f"timing_s/{k}": float(timing.get(k, 0.0)) for k in TIMING_KEYS},
            "critic/score/mean": float(scores.mean()),
            "actor/pg_loss_sum": upd["loss"],
            "actor/grad_norm": upd["grad_norm"],
            "response_length/mean": float(mask.sum(-1).float().mean()),
            "prompt_length/mean": float(
                batch.batch["attention_mask"][:, : -cfg.response_length].sum(-1).float().mean()
            ),
            "responses_sha": _digest(batch.batch["responses"]),
            "rows": len(batch),
        }
        self.log.write(json.dumps(record) + "\n")
        self.log.flush()
        return record

    def rewards(self, batch) -> torch.Tensor:
        tok = self.tokenizer
        scores = []
        for row, truth in zip(batch.batch["responses"], batch.non_tensor_batch["ground_truth"], strict=True):
            text = tok.decode(row, skip_special_tokens=True)
            scores.append(rule_reward(text, str(truth)))
        return torch.tensor(scores, dtype=torch.float32)


def _scalar(value):
    from verl.utils.metric.utils import Metric

    if isinstance(value, list):
        return [_scalar(v) for v in value] if value else [np.nan]
    if isinstance(value, Metric):
        return value.aggregate()
    return float(value)


def _digest(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()[:16]


def divergence(a: dict, b: dict, init: dict) -> dict:
    """The two runs' weights: max |Δ| / max |w| over all parameters (``max_rel``), the RMSE between them and
    each run's RMSE drift from the initial weights (Figure 8a's columns)."""
    top = wmax = sq = sa = sb = n = 0.0
    for name, w0 in init.items():
        x, y = a[name], b[name]
        top = max(top, float((x - y).abs().max()))
        wmax = max(wmax, float(x.abs().max()))
        sq += float((x - y).pow(2).sum())
        sa += float((x - w0).pow(2).sum())
        sb += float((y - w0).pow(2).sum())
        n += x.numel()
    rmse, da, db = (sq / n) ** 0.5, (sa / n) ** 0.5, (sb / n) ** 0.5
    return {"max_abs": top, "max_rel": top / wmax, "rmse": rmse, "drift_a": da, "drift_b": db}


def run_driver(cfg: DriverConfig, out: Path, log=print, meta: dict | None = None) -> Path:
    """Both runs in lockstep (per step: verl's engine, then PrefixFlow's); returns ``out``. ``meta`` (e.g. the
    git revision) goes into ``<out>/config.json`` beside the settings."""
    threads = torch.get_num_threads()
    torch.set_num_threads(int(cfg.threads))
    try:
        return _run_driver(cfg, out, log, meta or {})
    finally:
        torch.set_num_threads(threads)


def _run_driver(cfg: DriverConfig, out: Path, log, meta: dict) -> Path:
    select_cpu_platform()
    import prefixflow.integrations.verl  # noqa: F401  (registers PrefixFlow's engine with verl)

    init_one_rank()
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer()
    width = 8 + 4 * cfg.facts + 6  # template, facts, question
    (out / "config.json").write_text(json.dumps({**vars(cfg), "max_prompt_length": width, **meta}, indent=1))
    with tempfile.TemporaryDirectory(prefix="pf-verl-driver-") as tmp:
        # the dataset is rebuilt from the seed; outside ``out``, where pf-bench would read it as a record
        data = Path(tmp) / "data" / "train.parquet"
        write_dataset(data, prompts=cfg.steps * cfg.prompts_per_step, facts=cfg.facts, seed=cfg.seed)
        prompts = load_prompts(data, tok, width)
        save_model(Path(tmp) / "model", tok, cfg)
        runs = [Run(name, Path(tmp) / "model", tok, cfg, out / f"{name}.jsonl") for name in ENGINES]
        init = runs[0].weights()
        with (out / "divergence.jsonl").open("w") as div:
            for step in range(1, cfg.steps + 1):
                recs = [r.step(step, prompts) for r in runs]
                d = divergence(runs[0].weights(), runs[1].weights(), init)
                div.write(json.dumps({"step": step, "run_a": "verl", "run_b": "prefixflow", **d}) + "\n")
                div.flush()
                log(
                    f"step {step}: " + ", ".join(
                        f"{r['engine']} step {r['timing_s/step']:.2f}s update {r['timing_s/update_actor']:.2f}s "
                        f"reward {r['critic/score/mean']:.3f}" for r in recs
                    ) + f", weights max|Δ|/max|w| {d['max_rel']:.2e}"
                )  # fmt: skip
        for r in runs:
            r.log.close()
    return out
