"""Reading a user's rollouts (JSONL, Parquet, or a ``pf-bench rl`` trace folder) into groups of token sequences.

The layout is sniffed from the column names (JSONL: the first row's keys), in this order:

* ``verl``: ``prompts`` (left-padded), ``responses`` (right-padded), ``attention_mask`` (``[prompt + response]``,
  1 on real tokens), grouped by ``uid`` (verl's ``DataProto`` batch keys, one row per sample);
* ``prompt-response``: ``prompt_ids`` and ``completion_ids`` (TRL's names) or ``response_ids``, grouped by
  ``group_id`` or ``uid`` when present, else by identical ``prompt_ids``;
* ``sequences``: ``input_ids`` or ``token_ids`` (prompt and response in one) with ``group_id`` or ``uid``;
* ``trl-completions``: ``prompt`` and ``completion`` text (TRL's ``log_completions`` table,
  ``completions/completions_NNNNN.parquet``), and ``verl-generations``: ``input`` and ``output`` text (verl's
  ``trainer.rollout_data_dir`` JSONL); both need a tokenizer (:mod:`harness.rollout_stats.text`) and are
  grouped by identical prompt text.

A ``step`` column, when present, joins the group key (the same prompt at two steps is two groups). A folder
holding ``manifest.json`` is a frozen trace of ``pf-bench rl`` (``harness.rl.trace``): every group of every step.
Untrusted input: bounded bytes and rows, token ids must be ints in ``[0, 2^31)``, and every refusal is one
:class:`RolloutError` line naming the row and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from harness.rollout_stats.text import TextTokenizer, message_key

__all__ = ["Group", "Rollouts", "RolloutError", "read_rollouts", "LAYOUTS", "MAX_BYTES", "MAX_ROWS"]

MAX_BYTES = 256 * 2**20
MAX_ROWS = 1_000_000
MAX_TOKEN = 2**31  # token ids are below this (and sort as big-endian uint32 in ``stats``)
GROUP_COLUMNS = ("group_id", "uid")
LAYOUTS = {  # the layout -> its column names, as docs/workload.md lists them
    "verl": "prompts + responses + attention_mask [+ uid]",
    "prompt-response": "prompt_ids + completion_ids|response_ids [+ group_id|uid]",
    "sequences": "input_ids|token_ids + group_id|uid",
    "trl-completions": "prompt + completion (text; --tokenizer)",
    "verl-generations": "input + output (text; --tokenizer)",
}
TEXT = {"trl-completions": ("prompt", "completion"), "verl-generations": ("input", "output")}


class RolloutError(ValueError):
    """A rollouts file that cannot be read; the message is one line naming the file, the row and the field."""


@dataclass
class Group:
    """One rollout group: its samples' full token sequences; ``prompt_lens`` is None where the file gives no
    prompt boundary (the ``sequences`` layout: the group's common prefix is then the prefix)."""

    key: str
    seqs: list[np.ndarray]
    prompt_lens: list[int] | None


@dataclass
class Rollouts:
    layout: str
    groups: list[Group]

    @property
    def samples(self) -> int:
        return sum(len(g.seqs) for g in self.groups)


def sniff(columns: set[str], where: str) -> str:
    """The layout of a file with these ``columns``, or a one-line refusal listing the accepted ones."""
    if {"prompts", "responses", "attention_mask"} <= columns:
        return "verl"
    if "prompt_ids" in columns and columns & {"completion_ids", "response_ids"}:
        return "prompt-response"
    if columns & {"input_ids", "token_ids"} and columns & set(GROUP_COLUMNS):
        return "sequences"
    for layout, fields in TEXT.items():
        if set(fields) <= columns:
            return layout
    shown = ", ".join(sorted(columns)[:12]) or "none"
    accepted = "; ".join(f"{k}: {v}" for k, v in LAYOUTS.items())
    raise RolloutError(f"{where}: no known rollout layout in its columns ({shown}); accepted: {accepted}")


def _first(columns, names) -> str | None:
    return next((n for n in names if n in columns), None)


def _ids(value: Any, row: int, field: str) -> np.ndarray:
    """A JSON row's token-id list as int64, or a refusal naming the row, the field and the bad entry."""
    if not isinstance(value, list):
        raise RolloutError(f"row {row}: {field} must be a list of token ids, got {type(value).__name__}")
    for i, t in enumerate(value):
        if type(t) is not int or not 0 <= t < MAX_TOKEN:
            raise RolloutError(f"row {row}: {field}[{i}] is {t!r}; token ids must be ints in [0, 2^31)")
    return np.asarray(value, dtype=np.int64)


def _key(value: Any, row: int, field: str) -> str:
    if value is None or isinstance(value, (list, dict, float)):
        raise RolloutError(f"row {row}: {field} must be a string or an int, got {value!r:.40}")
    return str(value)


class _Builder:
    """Rows of one layout -> groups (in first-seen order)."""

    def __init__(self, layout: str, columns: set[str], tokenizer: str | None, where: str) -> None:
        self.layout = layout
        self.text = None
        if layout in TEXT:
            if tokenizer is None:
                raise RolloutError(
                    f"{where}: holds text ({layout}: {LAYOUTS[layout].split(' (')[0]}); pass --tokenizer "
                    "(the model's tokenizer: a Hugging Face name or folder) to count its tokens"
                )
            self.text = TextTokenizer(tokenizer, RolloutError)
        group_cols = {"verl": ("uid",), "prompt-response": GROUP_COLUMNS, "sequences": GROUP_COLUMNS}
        self.group_col = _first(columns, group_cols.get(layout, ()))
        self.step = "step" in columns
        self.response = _first(columns, ("completion_ids", "response_ids"))
        self.seq = _first(columns, ("input_ids", "token_ids"))
        self.groups: dict[tuple, Group] = {}  # (step, group id / prompt) -> its group

    def needed(self) -> list[str]:
        cols = {
            "verl": ["prompts", "responses", "attention_mask"],
            "prompt-response": ["prompt_ids", self.response],
            "sequences": [self.seq],
            **{k: list(v) for k, v in TEXT.items()},
        }[self.layout]
        return cols + [c for c in (self.group_col, "step" if self.step else None) if c]

    def token_fields(self) -> set[str]:
        """The fields that hold token ids (checked as such); text and keys are read as they are."""
        return set() if self.text is not None else set(self.needed()) - {self.group_col, "step"}

    def add(self, row: int, get) -> None:
        """Add row ``row``; ``get(field)`` returns a field's value (token fields as int64 arrays)."""
        if self.layout == "verl":
            prompt, seq = _verl_row(row, get("prompts"), get("responses"), get("attention_mask"))
        elif self.layout == "prompt-response":
            prompt = get("prompt_ids")
            seq = np.concatenate([prompt, get(self.response)])
        elif self.text is not None:
            p_field, c_field = TEXT[self.layout]
            raw = get(p_field)
            prompt = self.text.prompt(raw, row, p_field)
            seq = np.concatenate([prompt, self.text.completion(get(c_field), row, c_field)])
        else:
            prompt, seq = None, get(self.seq)
        if len(seq) == 0:
            raise RolloutError(f"row {row}: the sample has no tokens")
        if self.group_col is not None:
            ident: str | bytes = _key(get(self.group_col), row, self.group_col)
        elif self.text is not None:  # the logged prompt itself (its text, not its ids)
            ident = message_key(raw)
        else:  # prompt-response or verl without a group column: identical prompts form a group
            ident = prompt.astype(">u4").tobytes()
        step = _key(get("step"), row, "step") if self.step else None
        group = self.groups.get((step, ident))
        if group is None:
            label = ident if self.group_col is not None else f"prompt {len(self.groups) + 1}"
            label = label if step is None else f"step {step}/{label}"
            group = self.groups[(step, ident)] = Group(label, [], None if prompt is None else [])
        group.seqs.append(seq)
        if prompt is not None:
            group.prompt_lens.append(len(prompt))

    def rollouts(self) -> Rollouts:
        return Rollouts(self.layout, list(self.groups.values()))


def _verl_row(row: int, prompts, responses, mask) -> tuple[np.ndarray, np.ndarray]:
    p, r = len(prompts), len(responses)
    if len(mask) != p + r:
        raise RolloutError(
            f"row {row}: attention_mask has {len(mask)} entries, prompts + responses have {p} + {r}"
        )
    if ((mask != 0) & (mask != 1)).any():
        raise RolloutError(f"row {row}: attention_mask must hold only 0 and 1")
    on = mask.astype(bool)
    prompt = prompts[on[:p]]
    return prompt, np.concatenate([prompt, responses[on[p:]]])


def _jsonl(path: Path, max_rows: int, tokenizer: str | None) -> Rollouts:
    builder = None
    n = 0
    with path.open("rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            n += 1
            if n > max_rows:
                raise RolloutError(f"{path}: more than {max_rows} rows (raise --max-rows)")
            try:
                obj = json.loads(raw)
            except (ValueError, RecursionError) as e:
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise RolloutError(f"{path}: line {line_no} is not JSON ({msg})") from None
            if not isinstance(obj, dict):
                raise RolloutError(f"{path}: line {line_no} is not a JSON object")
            if builder is None:
                builder = _Builder(sniff(set(obj), str(path)), set(obj), tokenizer, str(path))
                token_fields = builder.token_fields()
            missing = [c for c in builder.needed() if c not in obj]
            if missing:
                raise RolloutError(f"{path}: row {n} lacks {missing[0]!r} (the {builder.layout} layout)")

            def get(field, obj=obj, row=n, token_fields=token_fields):
                return _ids(obj[field], row, field) if field in token_fields else obj[field]

            builder.add(n, get)
    if builder is None:
        raise RolloutError(f"{path}: no rows")
    return builder.rollouts()


def _parquet_ids(table, field: str, path: Path) -> list[np.ndarray]:
    """A Parquet list<int> column as one int64 array per row, checked like a JSON row's."""
    import pyarrow as pa

    col = table.column(field).combine_chunks()
    if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)) or not pa.types.is_integer(
        col.type.value_type
    ):
        raise RolloutError(f"{path}: column {field} must be a list of integer token ids, got {col.type}")
    if col.null_count:
        row = int(np.flatnonzero(np.asarray(col.is_null()))[0]) + 1
        raise RolloutError(f"{path}: row {row}: {field} is null")
    offsets = np.asarray(col.offsets, dtype=np.int64)
    values = col.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    offsets = offsets - offsets[0]
    flat = values.to_numpy(zero_copy_only=False).astype(np.int64)  # nulls inside a list become floats: below
    bad = np.flatnonzero(np.asarray(values.is_null()) | (flat < 0) | (flat >= MAX_TOKEN))
    if len(bad):
        i = int(bad[0])
        row = int(np.searchsorted(offsets, i, side="right"))
        value = values[i].as_py()
        raise RolloutError(
            f"{path}: row {row}: {field}[{i - offsets[row - 1]}] is {value!r}; token ids must be ints in [0, 2^31)"
        )
    return np.split(flat, offsets[1:-1])


def _parquet(path: Path, max_rows: int, tokenizer: str | None) -> Rollouts:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        rows = pf.metadata.num_rows
        names = set(pf.schema_arrow.names)
    except (pa.ArrowException, OSError) as e:
        raise RolloutError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
    if rows > max_rows:
        raise RolloutError(f"{path}: more than {max_rows} rows ({rows}; raise --max-rows)")
    if rows == 0:
        raise RolloutError(f"{path}: no rows")
    builder = _Builder(sniff(names, str(path)), names, tokenizer, str(path))
    try:
        table = pf.read(columns=builder.needed())
    except (pa.ArrowException, OSError) as e:
        raise RolloutError(f"{path}: cannot read its columns ({str(e).splitlines()[0]})") from None
    token_fields = builder.token_fields()
    data = {
        f: _parquet_ids(table, f, path) if f in token_fields else table.column(f).to_pylist()
        for f in builder.needed()
    }
    for i in range(rows):
        builder.add(i + 1, lambda field, i=i: data[field][i])
    return builder.rollouts()


def _trace(folder: Path, max_bytes: int, max_rows: int) -> Rollouts:
    """Every group of every step of a ``pf-bench rl`` trace folder (validated and hash-checked as replay does)."""
    from harness.rl.io import TraceError
    from harness.rl.trace import load_trace

    try:
        trace = load_trace(folder)
        size = sum((folder / s.inputs.file).stat().st_size for s in trace.manifest.steps)
        if size > max_bytes:
            raise RolloutError(f"{folder}: its step files hold {size} bytes, over --max-bytes {max_bytes}")
        groups: list[Group] = []
        for step in trace.manifest.steps:
            for g, group in enumerate(trace.groups(step)):
                prompt = group.prompt.numpy().astype(np.int64)
                seqs = [np.concatenate([prompt, r.numpy().astype(np.int64)]) for r in group.responses]
                groups.append(Group(f"{step.step}/g{g}", seqs, [len(prompt)] * len(seqs)))
                if sum(len(x.seqs) for x in groups) > max_rows:
                    raise RolloutError(f"{folder}: more than {max_rows} samples (raise --max-rows)")
    except (TraceError, OSError) as e:
        raise RolloutError(str(e).splitlines()[0]) from None
    return Rollouts("pf-bench-trace", groups)


def read_rollouts(
    path: str | Path, max_bytes: int = MAX_BYTES, max_rows: int = MAX_ROWS, tokenizer: str | None = None
) -> Rollouts:
    """The groups of a rollouts file (``.jsonl``, ``.parquet``) or trace folder; raises :class:`RolloutError`.
    ``tokenizer``: for the text layouts, a Hugging Face tokenizer name or folder."""
    path = Path(path)
    if path.is_dir():
        if not (path / "manifest.json").is_file():
            raise RolloutError(f"{path}: a folder, but not a pf-bench rl trace (no manifest.json)")
        return _trace(path, max_bytes, max_rows)
    if not path.is_file():
        raise RolloutError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".parquet"):
        raise RolloutError(f"{path}: unknown extension {suffix or '(none)'!r}; expected .jsonl or .parquet")
    size = path.stat().st_size
    if size > max_bytes:
        raise RolloutError(f"{path}: {size} bytes, over the limit of {max_bytes} (raise --max-bytes)")
    return (_jsonl if suffix == ".jsonl" else _parquet)(path, max_rows, tokenizer)
