"""CPU shims and fixtures for the verl tests (tests only: the library registers nothing of this).

verl 0.9.1 assumes an accelerator: the CPU platform registered through verl's own plugin registry
(``harness.peers.verl_platform``, shared with pf-bench's verl contenders) is selected before verl's engines import.
One gloo rank. No verl file is patched.
"""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch

from harness.peers.verl_platform import init_one_rank, select_cpu_platform  # noqa: E402,F401

select_cpu_platform()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random-weight Qwen3 saved as verl's engines load one (a module imports it to use it)."""
    path = tmp_path_factory.mktemp("qwen3-tiny")
    save_tiny_model(path, "qwen3")
    return path


def save_tiny_model(path, model_type: str = "qwen3", seed: int = 0) -> None:
    """A tiny HF causal LM from a config (random weights), saved where verl's HFModelConfig reads it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        max_position_embeddings=256,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path)


def build_engine(
    model_dir,
    *,
    strategy: str = "fsdp2",
    vendor: str | None = None,
    checkpointing: bool = False,
    use_remove_padding: bool = False,
    attn: str | None = "sdpa",
    use_torch_compile: bool = False,
    **engine_overrides,
):
    """verl's own engine (``vendor=None``) or the one registered under ``vendor``, built the way verl's
    TrainingWorker builds it: ``EngineRegistry.new`` then ``initialize()``, in fp32, no grad clipping.
    ``attn``: the model's attn_implementation override (None: verl's default, flash_attention_2).
    ``engine_overrides``: further ``FSDPEngineConfig`` fields."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    init_one_rank()
    model_config = HFModelConfig(
        path=str(model_dir),
        load_tokenizer=False,
        override_config={} if attn is None else {"attn_implementation": attn},
        use_remove_padding=use_remove_padding,
        enable_gradient_checkpointing=checkpointing,
    )
    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    engine_config = FSDPEngineConfig(
        strategy=strategy,
        model_dtype="fp32",
        use_torch_compile=use_torch_compile,
        use_remove_padding=use_remove_padding,
        **{"use_dynamic_bsz": False, "mixed_precision": fp32, **engine_overrides},
    )
    optimizer_config = FSDPOptimizerConfig(lr=1e-3, clip_grad=1e30)
    previous = os.environ.get("VERL_ENGINE_VENDOR")
    try:
        if vendor is None:
            os.environ.pop("VERL_ENGINE_VENDOR", None)
        else:
            os.environ["VERL_ENGINE_VENDOR"] = vendor
        engine = EngineRegistry.new(
            model_type="language_model",
            backend=strategy,
            model_config=model_config,
            engine_config=engine_config,
            optimizer_config=optimizer_config,
            checkpoint_config=CheckpointConfig(),
        )
    finally:
        if previous is None:
            os.environ.pop("VERL_ENGINE_VENDOR", None)
        else:
            os.environ["VERL_ENGINE_VENDOR"] = previous
    engine.initialize()
    return engine


def grpo_batch(
    *,
    uids=("a", "b"),
    group: int = 4,
    prompt_width: int = 7,
    response_width: int = 6,
    seed: int = 0,
    vocab: int = 128,
    shared_prompts: bool = True,
    temperature: float = 1.0,
    old_spread: float = 1.5,
):
    """A verl ``DataProto`` of GRPO groups: left-padded prompts (one prompt per uid, lengths differ), right-padded
        responses of varied lengths, a scalar advantage per response broadcast over its tokens, old and reference
        log-probs. ``shared_prompts=False`` gives the rows of a uid different prompts (the fallback path). Old log-probs
    lie around the tiny model's ``-log(vocab)`` with ``old_spread``: ratios beyond ``1 +- 0.2`` and beyond the dual
    clip's 3 occur on some tokens."""
    from verl import DataProto

    g = torch.Generator().manual_seed(seed)
    rows = len(uids) * group
    prompts = torch.zeros(rows, prompt_width, dtype=torch.long)
    responses = torch.zeros(rows, response_width, dtype=torch.long)
    attention = torch.zeros(rows, prompt_width + response_width, dtype=torch.long)
    uid_col = []
    for u, uid in enumerate(uids):
        plen = prompt_width - u  # uids' prompts differ in length: left padding in the batch
        prompt = torch.randint(3, vocab, (plen,), generator=g)
        for j in range(group):
            r = u * group + j
            if not shared_prompts:
                prompt = torch.randint(3, vocab, (plen,), generator=g)
            prompts[r, prompt_width - plen :] = prompt
            attention[r, prompt_width - plen : prompt_width] = 1
            rlen = response_width - (j % 3)
            responses[r, :rlen] = torch.randint(3, vocab, (rlen,), generator=g)
            attention[r, prompt_width : prompt_width + rlen] = 1
            uid_col.append(uid)
    response_mask = attention[:, prompt_width:].clone()
    scores = torch.randn(rows, generator=g)
    advantages = scores[:, None] * response_mask
    centre = -float(np.log(vocab))
    old = centre + old_spread * torch.randn(rows, response_width, generator=g)
    ref = centre + 0.5 * torch.randn(rows, response_width, generator=g)
    input_ids = torch.cat([prompts, responses], dim=1)
    position_ids = torch.clamp(torch.cumsum(attention, dim=1) - 1, min=0)
    batch = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": input_ids,
        "attention_mask": attention,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "advantages": advantages.float(),
        "old_log_probs": (old * response_mask).float(),
        "ref_log_prob": (ref * response_mask).float(),
    }
    return DataProto.from_dict(
        tensors=batch,
        non_tensors={"uid": np.array(uid_col, dtype=object)},
        meta_info={"temperature": temperature},
    )


def engine_batch(
    proto,
    *,
    micro_batch_size: int,
    global_batch_size: int | None = None,
    use_remove_padding: bool = False,
    max_token_len: int | None = None,
):
    """The TensorDict verl's trainer and TrainingWorker hand to ``engine.train_batch`` for one mini-batch;
    ``max_token_len``: ``use_dynamic_bsz`` with that ``ppo_max_token_len_per_gpu``."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    td = left_right_2_no_padding(proto.to_tensordict())
    tu.assign_non_tensor(
        td,
        calculate_entropy=False,
        global_batch_size=global_batch_size,
        use_remove_padding=use_remove_padding,
        use_dynamic_bsz=max_token_len is not None,
        max_token_len_per_gpu=max_token_len,
        micro_batch_size_per_gpu=micro_batch_size,
        use_fused_kernels=False,
        global_token_num=None,
    )
    return td


def actor_config(**overrides):
    """verl's actor config (its dataclass, as the trainer converts it) with the given loss options."""
    from verl.workers.config import FSDPActorConfig

    base = dict(
        strategy="fsdp2",
        ppo_mini_batch_size=2,
        ppo_micro_batch_size_per_gpu=4,
        use_dynamic_bsz=False,
        rollout_n=4,
    )
    base.update(overrides)
    return FSDPActorConfig(**base)


def train_once(
    model_dir,
    vendor,
    actor,
    proto,
    *,
    micro_batch_size: int,
    global_batch_size,
    max_token_len=None,
    **engine_kw,
):
    """One ``engine.train_batch(data, partial(ppo_loss, config=actor))`` from the saved weights. Returns the
    full gradients read just before verl's optimizer step (verl zeroes them on leaving train mode) and the
    output."""
    from functools import partial

    from verl.workers.utils.losses import ppo_loss

    engine = build_engine(model_dir, vendor=vendor, **engine_kw)
    grads: dict[str, torch.Tensor] = {}
    step = engine.optimizer_step

    def snapshot_then_step():
        for name, p in engine.module.named_parameters():
            g = p.grad
            grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
        return step()

    engine.optimizer_step = snapshot_then_step
    data = engine_batch(
        proto,
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        use_remove_padding=engine_kw.get("use_remove_padding", False),
        max_token_len=max_token_len,
    )
    with engine.train_mode():
        out = engine.train_batch(data, loss_function=partial(ppo_loss, config=actor))
    return grads, out


def metric_values(out) -> dict[str, float]:
    """verl's metrics of a ``train_batch`` output, each aggregated as verl aggregates it."""
    from verl.utils.metric.utils import Metric

    values = {}
    for key, value in out["metrics"].items():
        if isinstance(value, list) and value and isinstance(value[0], Metric):
            merged = Metric(value[0].aggregation)
            for m in value:
                merged.extend(m)
            value = merged.aggregate()
        elif isinstance(value, Metric):
            value = value.aggregate()
        elif isinstance(value, list):
            value = float(np.mean(value))
        values[key] = float(value)
    return values


def compare(model_dir, actor, proto, *, micro_batch_size: int = 4, global_batch_size=8, **engine_kw) -> dict:
    """verl's FSDP engine and PrefixFlow's on the same data: the worst gradient difference over parameters
    (``norm``: |g - g_verl| / |g_verl| over all parameters together; ``tensor``: the same per parameter, worst;
    ``max``: max abs difference / max |g_verl| per parameter, worst), the losses and metrics."""
    from prefixflow.integrations.verl import VENDOR

    kw = dict(micro_batch_size=micro_batch_size, global_batch_size=global_batch_size, **engine_kw)
    want, out_want = train_once(model_dir, None, actor, proto, **kw)
    got, out_got = train_once(model_dir, VENDOR, actor, proto, **kw)
    assert want.keys() == got.keys()
    diff = torch.cat([(got[k] - want[k]).flatten() for k in want])
    norm = float(diff.norm() / torch.cat([w.flatten() for w in want.values()]).norm())
    tensor = max(float((got[k] - want[k]).norm() / want[k].norm()) for k in want)
    worst = max(float((got[k] - want[k]).abs().max() / want[k].abs().max()) for k in want)
    return {
        "norm": norm,
        "tensor": tensor,
        "max": worst,
        "grad_norm": float(want["lm_head.weight"].norm()),
        "loss": (out_want["loss"], out_got["loss"]),
        "metrics": (metric_values(out_want), metric_values(out_got)),
    }


def dp_worker(rank: int, world: int, port: int, model_dir: str, cases: list[dict], out_path: str) -> None:
    """One of ``world`` gloo ranks (``torch.multiprocessing.spawn``): verl's dispatch hands rank ``r`` the
    ``r``-th contiguous chunk of the batch; rows are interleaved first, so each uid group spans every rank.
    For each case (``actor``: loss options, ``kw``: ``train_once`` options) both engines train the rank's chunk;
    rank 0 saves the gathered full gradients, the losses and the metrics, one entry per case."""
    from prefixflow.integrations.verl import VENDOR

    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        proto = grpo_batch(uids=("a", "b"), seed=4)
        order = np.array([0, 4, 1, 5, 2, 6, 3, 7])
        per = len(order) // world
        shard = proto[order[rank * per : (rank + 1) * per]]
        results = []
        for case in cases:
            actor = actor_config(**case["actor"])
            kw = dict(micro_batch_size=2, global_batch_size=len(order), **case.get("kw", {}))
            want, out_want = train_once(model_dir, None, actor, shard, **kw)
            got, out_got = train_once(model_dir, VENDOR, actor, shard, **kw)
            results.append(
                {
                    "want": want,
                    "got": got,
                    "loss": (out_want["loss"], out_got["loss"]),
                    "metrics": (metric_values(out_want), metric_values(out_got)),
                }
            )
        if rank == 0:
            torch.save(results, out_path)
    finally:
        torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
