"""Tiny, offline TRL set-up shared by the TRL tests: a WordLevel tokenizer, prompts, a reward, a model."""

from __future__ import annotations

import torch

WORDS = [f"w{i}" for i in range(60)]
SPECIALS = ["<pad>", "<eos>", "<unk>"]


def tokenizer():
    """A local ``PreTrainedTokenizerFast`` (WordLevel over 60 words + pad/eos/unk); nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def dataset(n_prompts: int = 4, seed: int = 0):
    """Prompts of different lengths (so TRL left-pads them)."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(n_prompts):
        length = 5 + 3 * i
        ids = torch.randint(0, len(WORDS), (length,), generator=gen).tolist()
        prompts.append(" ".join(WORDS[j] for j in ids))
    return Dataset.from_dict({"prompt": prompts})


def reward_even_words(completions, **kwargs):
    """A deterministic reward with spread inside each group: the share of even-numbered words."""
    out = []
    for text in completions:
        text = text if isinstance(text, str) else text[-1]["content"]  # conversational: the last message
        words = [w for w in text.split() if w.startswith("w")]
        out.append(sum(int(w[1:]) % 2 == 0 for w in words) / max(len(words), 1))
    return out


def model(family: str = "qwen3", seed: int = 0, dtype=torch.float32):
    """A tiny HF causal LM over the tokenizer's vocabulary, attention-heavy weights."""
    from prefixflow.integrations import hf

    m = hf.build_hf_model(
        f"{family}-tiny", dtype=dtype, seed=seed, overrides={"vocab_size": len(SPECIALS) + len(WORDS)}
    )
    with torch.no_grad():
        for layer in m.model.layers:
            for name in ("q_proj", "k_proj", "qkv_proj"):  # Phi-3 fuses q/k/v
                if hasattr(layer.self_attn, name):
                    getattr(layer.self_attn, name).weight.mul_(4.0)
        m.lm_head.weight.mul_(8.0)  # a peaked policy: log-prob gradients well above fp32 noise
    m.generation_config.pad_token_id = 0
    m.generation_config.eos_token_id = 1
    return m


def config(tmp_path, **overrides):
    from trl import GRPOConfig

    base = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=10,
        max_steps=1,
        beta=0.0,
        seed=0,
        data_seed=0,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,  # no clipping: the SGD step is the gradient
        gradient_checkpointing=True,  # TRL's default (non-reentrant, per decoder layer)
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        # EOS grows likelier after 2 tokens: completions of different lengths in every group
        generation_kwargs={"exponential_decay_length_penalty": (2, 1.6)},
    )
    return GRPOConfig(**{**base, **overrides})


def trainer(tmp_path, cls=None, model=None, dataset=None, **options):
    """A trainer (PrefixFlowGRPOTrainer by default) over the tiny set-up; ``prefixflow_*``/``peft_config``
    options go to the constructor, the rest to ``GRPOConfig``."""
    from prefixflow.integrations.trl import PrefixFlowGRPOTrainer

    ctor = ("peft_config", "verify_first_step", "verify_tolerance", "rollout_func")
    extra = {k: options.pop(k) for k in list(options) if k.startswith("prefixflow_") or k in ctor}
    cls = cls or PrefixFlowGRPOTrainer
    if cls is not PrefixFlowGRPOTrainer:
        extra = {k: v for k, v in extra.items() if k in ("peft_config", "rollout_func")}
    return cls(
        model=model if model is not None else globals()["model"](),
        reward_funcs=reward_even_words,
        args=config(tmp_path, **options),
        train_dataset=dataset if dataset is not None else globals()["dataset"](),
        processing_class=tokenizer(),
        **extra,
    )


def micro_batch(tr, seed: int = 0, drift: float = 0.3, model_keys: tuple[str, ...] = ()) -> dict:
    """One micro-batch exactly as TRL's training_step sees it, with off-policy old log-probs and reference
    log-probs (current ones + ``drift`` noise) injected so clipping, the KL and the masks are active.
    ``model_keys``: the batch's extra model inputs TRL's log-prob forward also takes (a VLM's images)."""
    tr.model.train()
    tr.current_gradient_accumulation_steps = tr.args.gradient_accumulation_steps  # set by train() otherwise
    torch.manual_seed(seed)
    inputs = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    gen = torch.Generator().manual_seed(seed)
    shape = inputs["completion_ids"].shape
    with torch.no_grad():
        logps, _, _ = tr._get_per_token_logps_and_entropies(
            tr.model,
            torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
            shape[1],
            **{k: inputs[k] for k in model_keys if k in inputs},
        )
    noise = lambda: drift * torch.randn(shape, generator=gen, dtype=logps.dtype)  # noqa: E731
    inputs["old_per_token_logps"] = logps + noise()
    inputs["ref_per_token_logps"] = logps + noise()
    return inputs


def grads(model):
    return [p.grad.detach().clone() for p in model.parameters() if p.requires_grad]


def trl_and_prefixflow_grads(tr, inputs):
    """(TRL loss, TRL grads, PrefixFlow loss, PrefixFlow grads) on the same micro-batch."""
    model = tr.model
    model.zero_grad(set_to_none=True)
    want_loss = tr.compute_loss(model, inputs)
    want_loss.backward()
    want = grads(model)
    model.zero_grad(set_to_none=True)
    got_loss = tr._prefixflow_update(model, inputs)
    return float(want_loss), want, float(got_loss), grads(model)


def fp64_norms(model) -> None:
    """Every RMSNorm and the RoPE tables compute in fp64 (HF's compute in fp32 even in fp64 models, and TRL's
    left padding puts prompts at other absolute positions, so fp32 tables differ); instance-level."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):

            def forward(x, m=module):
                variance = x.pow(2).mean(-1, keepdim=True)
                return m.weight * (x * torch.rsqrt(variance + m.variance_epsilon))

            module.forward = forward
        if type(module).__name__.endswith("RotaryEmbedding"):  # HF's RoPE tables are fp32 in every dtype

            def rotary(x, position_ids, m=module):
                dim = m.inv_freq.numel() * 2  # default RoPE: base^(-2i/dim), here in fp64
                base = m.config.rope_parameters["rope_theta"]
                inv = base ** -(torch.arange(0, dim, 2, dtype=torch.float64, device=x.device) / dim)
                freqs = position_ids[..., None].to(torch.float64) * inv
                emb = torch.cat((freqs, freqs), dim=-1)
                return (emb.cos() * m.attention_scaling).to(x.dtype), (emb.sin() * m.attention_scaling).to(
                    x.dtype
                )

            module.forward = rotary


class PlainLogProbs:
    """A stand-in for TRL's chunked LM-head kernel (``trl.kernels.ChunkedLogProbFunction``, whose online
    softmax accumulates in fp32 whatever the dtype): the same outputs from a plain ``log_softmax`` in the
    model's dtype. Only for fp64 comparisons; everything else in TRL's loss runs as shipped."""

    @staticmethod
    def apply(
        hidden, weight, bias, targets, temperature, chunk_size, softcap=None, logit_scale=1.0, outputs=()
    ):
        logits = hidden @ weight.T
        if bias is not None:
            logits = logits + bias
        logits = logits * logit_scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        lsm = torch.log_softmax(logits / temperature, dim=-1)
        logprobs = lsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = -(lsm.exp() * lsm).sum(-1) if "entropy" in outputs else None
        return logprobs, entropy, None, None, None


def fp64_trl(monkeypatch) -> None:
    """TRL's LM head in the model's dtype (see :class:`PlainLogProbs`)."""
    import trl.trainer.utils

    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", PlainLogProbs)


SYSTEM = "w1 w2 w3 w4 w5 w6"  # a shared system prompt / context


def system_dataset(n_prompts: int = 4, seed: int = 0):
    """Prompts that all begin with the same :data:`SYSTEM` context, then differ (and differ in length)."""
    from datasets import Dataset

    rows = dataset(n_prompts, seed)["prompt"]
    return Dataset.from_dict({"prompt": [f"{SYSTEM} {p}" for p in rows]})


TOOL_OUTPUT = [f"w{i}" for i in (50, 51, 52)]


def multi_turn_rollout(prompts, trainer):
    """A deterministic environment rollout (TRL's ``rollout_func``): assistant turn, tool output, assistant turn,
    EOS. The tool output carries no loss (``env_mask`` 0, TRL's ``tool_mask``). Completions ``2k`` and ``2k+1``
    of a prompt share their first turn and its tool output (a shared multi-turn prefix)."""
    tok = trainer.processing_class
    vocab = tok.get_vocab()
    eos = tok.eos_token_id
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": None, "env_mask": []}
    seen: dict[str, int] = {}
    for prompt in prompts:
        index = seen[prompt] = seen.get(prompt, -1) + 1
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        seed = sum(ids) * 131 + len(ids)
        first = torch.Generator().manual_seed(seed + index // 2)
        second = torch.Generator().manual_seed(seed + 1000 + index)
        turn1 = [vocab[w] for w in WORDS[:48]]
        turn1 = [
            turn1[int(j)]
            for j in torch.randint(0, 48, (int(torch.randint(2, 5, (1,), generator=first)),), generator=first)
        ]
        tool = [vocab[w] for w in TOOL_OUTPUT[: 2 + index // 2 % 2]]
        n2 = int(torch.randint(1, 4, (1,), generator=second))
        turn2 = [vocab[WORDS[int(j)]] for j in torch.randint(0, 48, (n2,), generator=second)] + [eos]
        out["prompt_ids"].append(ids)
        out["completion_ids"].append(turn1 + tool + turn2)
        out["env_mask"].append([1] * len(turn1) + [0] * len(tool) + [1] * len(turn2))
    return out


def saved_model(folder, family: str = "qwen3") -> str:
    """:func:`model` saved to ``folder`` (TRL loads its reference model from the path when ``beta`` > 0)."""
    m = model(family)
    m.save_pretrained(str(folder))
    return str(folder)
