"""The verl driver's task: a synthetic long-prefix RAG dataset in verl's parquet format, its word-level
tokenizer (with a chat template) and the rule reward.

Each prompt is one user message: a document of ``facts`` lines ``kI is vJ .`` and a question ``what is kI ?``
about one of them. ``reward_model.ground_truth`` is the fact's value; the reward is 1 where the response
contains it, else 0 (a tiny random model hits it by chance on about one row in five, so GRPO has a signal).
Columns as verl's GSM8K preprocessing writes them: ``data_source``, ``prompt`` (chat messages), ``ability``,
``reward_model`` (``style``, ``ground_truth``), ``extra_info``.
"""

from __future__ import annotations

import random
from pathlib import Path

import pandas as pd

__all__ = ["KEYS", "VALUES", "make_tokenizer", "rule_reward", "write_dataset"]

KEYS = tuple(f"k{i}" for i in range(32))
VALUES = tuple(f"v{i}" for i in range(16))
SPECIAL = ("<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>")
WORDS = ("doc:", "is", ".", "question:", "what", "?")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
DATA_SOURCE = "prefixflow/long_prefix_rag"


def make_tokenizer():
    """A whitespace word-level ``PreTrainedTokenizerFast`` over the task's words (64 ids with padding)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = SPECIAL + WORDS + KEYS + VALUES
    vocab = {w: i for i, w in enumerate(words)}
    core = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def write_dataset(path: str | Path, *, prompts: int, facts: int, seed: int = 0) -> Path:
    """Write ``prompts`` rows to ``path`` (parquet); documents hold ``facts - (i % 4)`` facts (prompt lengths
    differ: verl's batches are left-padded)."""
    rng = random.Random(seed)
    rows = []
    for i in range(prompts):
        keys = rng.sample(KEYS, min(len(KEYS), facts - (i % 4)))
        keys += [rng.choice(KEYS) for _ in range(facts - (i % 4) - len(keys))]
        table = {k: rng.choice(VALUES) for k in keys}
        asked = rng.choice(sorted(table))
        doc = " ".join(f"{k} is {table[k]} ." for k in keys)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"doc: {doc} question: what is {asked} ?"}],
                "ability": "retrieval",
                "reward_model": {"style": "rule", "ground_truth": table[asked]},
                "extra_info": {"split": "train", "index": i},
            }
        )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)
    return path


def rule_reward(response: str, ground_truth: str) -> float:
    """1.0 where the response's words contain the ground truth, else 0.0."""
    return 1.0 if ground_truth in response.split() else 0.0
