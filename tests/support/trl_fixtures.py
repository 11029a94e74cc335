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
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
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
