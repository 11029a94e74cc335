"""``pf-bench workload`` on logged rollout text: TRL's completions table and verl's generations dump through a
tokenizer (a word-level one built here), and the text layouts' one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from harness.cli import app
from harness.rollout_stats import read_rollouts, workload_stats

runner = CliRunner()


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    """A word-level Hugging Face tokenizer (one id per word or punctuation mark) that puts ``[BOS]`` before a
    text it is given (its special tokens), with a chat template that writes ``role: content`` per message
    and ``assistant:`` as the generation prompt (and no ``[BOS]``: a template's tokens are its own)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[BOS]", "user", "assistant", ":", "hello", "world", "yes", "no", "a", "b", "c"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    folder = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(folder)
    return str(folder)


def _chat(role: str, text: str) -> list[dict]:
    return [{"role": role, "content": text}]


def test_trls_completions_table_through_a_tokenizer(tmp_path, tokenizer):
    """TRL's ``completions_NNNNN.parquet`` (conversational): "user: hello world assistant:" is 6 tokens,
    "user: a assistant:" 5; a group is one prompt at one step."""
    table = pd.DataFrame(
        {
            "step": [1, 1, 1, 2],
            "prompt": [_chat("user", "hello world")] * 2 + [_chat("user", "a"), _chat("user", "hello world")],
            "completion": [_chat("assistant", t) for t in ("yes", "no a b", "b c", "yes")],
            "correctness_reward": [1.0, 0.0, 1.0, 1.0],
            "advantage": [0.5, -0.5, 0.0, 0.0],
        }
    )
    path = tmp_path / "completions_00002.parquet"
    table.to_parquet(path)
    stats = workload_stats(read_rollouts(path, tokenizer=tokenizer))
    assert stats.layout == "trl-completions" and (stats.groups, stats.singleton_groups) == (3, 2)
    assert (stats.baseline_tokens, stats.shared_tokens) == (7 + 9 + 7 + 7, (6 + 1 + 3) + 7 + 7)
    assert stats.prefix_len["min"] == 5 and stats.prefix_ratio["max"] == pytest.approx(6 / 7)
    assert stats.prefix_ratio["p50"] == pytest.approx((5 / 7 + 6 / 7) / 2)  # sorted 6/9, 5/7, 6/7, 6/7


def test_verls_generations_dump_through_a_tokenizer(tmp_path, tokenizer):
    """verl's ``rollout_data_dir`` JSONL: ``input``/``output`` text, grouped by the prompt at its step. A
    prompt string gets the tokenizer's ``[BOS]`` (3 tokens), a completion none."""
    path = _jsonl(
        tmp_path / "3.jsonl",
        [
            {"input": "hello world", "output": "yes no", "score": 1.0, "step": 3},
            {"input": "hello world", "output": "a", "score": 0.0, "step": 3},
        ],
    )
    res = runner.invoke(app, ["workload", str(path), "--tokenizer", tokenizer, "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["layout"] == "verl-generations" and out["groups"] == 1
    assert (out["baseline_tokens"], out["shared_tokens"]) == (5 + 4, 3 + 2 + 1)
    assert out["prefix_ratio"]["min"] == pytest.approx(3 / 5)
    assert out["prefix_ratio"]["max"] == pytest.approx(3 / 4)


@pytest.mark.parametrize(
    "rows, args, words",
    [
        ([{"prompt": "a", "completion": "b"}], [], "holds text (trl-completions: prompt + completion); pass --tokenizer"),
        ([{"input": "a", "output": "b"}], ["--tokenizer", "/nonexistent/tok"], "--tokenizer /nonexistent/tok: cannot load"),
        ([{"prompt": [{"role": "user", "content": [1]}], "completion": "b"}], ["--tokenizer", "TOK"],
         "row 1: prompt must be text or a list of {role, content} messages"),
        ([{"prompt": "a", "completion": 7}], ["--tokenizer", "TOK"], "row 1: completion must be text"),
    ],
)  # fmt: skip
def test_text_refusals_are_one_line(tmp_path, tokenizer, rows, args, words):
    path = _jsonl(tmp_path / "t.jsonl", rows)
    res = runner.invoke(app, ["workload", str(path), *[tokenizer if a == "TOK" else a for a in args]])
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and words in lines[0], res.output
