"""Token ids of logged rollout *text* (TRL's completions table, verl's ``rollout_data_dir`` dump), through the
user's tokenizer (``--tokenizer``).

The logs hold text, not the ids the trainer saw, so the counts are the tokenizer's view of that text:

* a prompt string is tokenized with the tokenizer's default special tokens (TRL's
  ``processing_class(text=prompts)``);
* a conversational prompt (a list of ``{role, content}`` messages, TRL's conversational datasets) goes
  through the tokenizer's chat template with the generation prompt (TRL's ``apply_chat_template(...,
  add_generation_prompt=True, tokenize=True)``; tools, which the log does not hold, are not rendered);
* a completion string is tokenized without special tokens (the logs decode completions without them, so a
  completion's end-of-sequence token is not counted); a conversational completion is the concatenation of
  its messages' contents, each tokenized so (the template's tokens between messages are not counted).

verl decodes its dump with ``skip_special_tokens=True``, so a verl prompt counts without its chat template's
special tokens: its prefix ratio reads slightly low.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

__all__ = ["TextTokenizer", "message_key"]


def _messages(value: Any) -> list[dict] | None:
    if isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    ):
        return value
    return None


def message_key(value: Any) -> str:
    """A prompt (text or messages) as a group key."""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


class TextTokenizer:
    """A Hugging Face tokenizer by name or local folder; ``error`` builds the caller's one-line refusal."""

    def __init__(self, name: str, error) -> None:
        from transformers import AutoTokenizer

        self.error = error
        try:
            self.tok = AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise error(f"--tokenizer {name}: cannot load it ({str(e).splitlines()[0][:200]})") from None
        self.name = name

    def _ids(self, text: str, special: bool = False) -> np.ndarray:
        return np.asarray(self.tok(text, add_special_tokens=special)["input_ids"], dtype=np.int64)

    def _shape_error(self, row: int, field: str):
        return self.error(f"row {row}: {field} must be text or a list of {{role, content}} messages")

    def prompt(self, value: Any, row: int, field: str) -> np.ndarray:
        if isinstance(value, str):
            return self._ids(value, special=True)
        messages = _messages(value)
        if messages is None:
            raise self._shape_error(row, field)
        if not getattr(self.tok, "chat_template", None):
            raise self.error(
                f"row {row}: {field} is a conversation and --tokenizer {self.name} has no chat template"
            )
        ids = self.tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        return np.asarray(ids, dtype=np.int64)

    def completion(self, value: Any, row: int, field: str) -> np.ndarray:
        if isinstance(value, str):
            return self._ids(value)
        messages = _messages(value)
        if messages is None:
            raise self._shape_error(row, field)
        parts = [self._ids(m["content"]) for m in messages]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
