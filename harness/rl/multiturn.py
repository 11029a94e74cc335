"""A synthetic multi-turn tool task: the policy calls a deterministic lookup tool, then answers from its reply.

One episode, as the policy sees it (prompt and tool reply are context, the two policy turns are trained)::

    prompt   BOS  s_1 .. s_S  QUERY k_q F_j        system prompt (the tool's schema), the question
    turn 1   n_1 .. n_R  k F  CALL                 a free-form note, then the call: a key and a field
    reply    RESULT k F t_1 .. t_D v_1 .. v_L END  the tool's answer: its text, then the value (loss-masked)
    turn 2   a_1 .. a_L  EOS                       the answer

The question asks field ``F_j`` of key ``k_q``. The tool holds a table of ``n_keys x fields`` entries, each
``reply_text`` tokens of text (what a search tool returns around its answer) and a value of ``value_len``
tokens, drawn per question, so only the tool knows them: the task needs the call. Values are
*typed* as in :mod:`harness.rl.task`: the i-th token of field f of key k is one of ``choices`` tokens that
belong to (k, f, i) alone, so a policy that calls the right key and field but never reads the reply scores
``1 / choices``, one that reads it scores 1, and a wrong call returns another value's type (0). A call that
is not a key and a field before CALL gets ``RESULT ERROR END``. The reward is the fraction of answer
positions right (``RetrievalTask.reward``'s rule), in [0, 1].

Rollouts branch at turns: ``calls`` turn-1 samples per prompt, then ``answers`` turn-2 samples after each
call and its reply, so a prompt's ``calls * answers`` paths form a tree: prompt -> call + reply nodes ->
answers. The note (``note_len`` tokens, no effect on the reward, as the text an agent writes before a call)
is taught uniform by the warm start, so the turn-1 samples differ and the tree really branches at turn 1.

``warm_start`` trains the whole episode supervised (turn-1 and answer tokens, label smoothing optional):
the smoothing leaves each sampled token a chance of being off, which GRPO learns to remove (as the Claim-2
retrieval task's warm start does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from harness.rl.task import BOS, EOS, N_SPECIAL, QUERY, train_supervised

__all__ = ["MultiTurnTask", "Episode", "MultiTurnRollout", "CALL", "RESULT", "END", "ERROR"]

CALL, RESULT, END, ERROR = N_SPECIAL, N_SPECIAL + 1, N_SPECIAL + 2, N_SPECIAL + 3
_OWN_SPECIAL = 4
_SYSTEM_SEED = 20_251_201  # the fixed system prompt (one for the whole task)
_SHAPE = ("system_len", "note_len", "fields", "value_len", "n_keys", "choices", "calls", "reply_text")


@dataclass(frozen=True)
class Episode:
    """One question: its prompt, the tool's table (``values[key, field]``: value tokens; ``texts[key,
    field]``: the reply's text before it), the asked key index and field, and the right answer (no EOS)."""

    prompt: torch.Tensor
    values: torch.Tensor  # [n_keys, fields, value_len] token ids
    texts: torch.Tensor  # [n_keys, fields, reply_text] token ids
    key: int
    field: int
    answer: torch.Tensor


@dataclass
class MultiTurnRollout:
    """A prompt's ``calls * answers`` paths (path ``c * answers + a``: answer a after call c): each response
    is turn 1 + tool reply + turn 2, with the loss mask (False on the reply); ``call_ok``: the call named the
    asked key and field; ``truncated``: a turn hit ``max_new_tokens`` without its terminator."""

    responses: list[torch.Tensor]
    loss_masks: list[torch.Tensor]
    answers: list[torch.Tensor]
    truncated: list[bool]
    call_ok: list[bool]


@dataclass(frozen=True)
class MultiTurnTask:
    """The task's shape (module doc): token layout, vocabulary, the tool, the reward and the branching
    rollout. Token ids: the specials of ``harness.rl.task``, CALL/RESULT/END/ERROR, one per field, 16 note
    symbols (system prompt, notes, reply text), one per key, then the typed value tokens."""

    system_len: int = 32
    note_len: int = 8
    fields: int = 4
    value_len: int = 4
    n_keys: int = 16
    choices: int = 4
    calls: int = 4
    reply_text: int = 0
    kind: ClassVar[str] = "multiturn"

    def __post_init__(self) -> None:
        for name in _SHAPE:
            value = getattr(self, name)
            least = 0 if name in ("note_len", "reply_text") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"task.{name} must be an int >= {least}, got {value!r}")

    # ---- vocabulary ---------------------------------------------------------------------------------
    @property
    def _field0(self) -> int:
        return N_SPECIAL + _OWN_SPECIAL

    @property
    def _note0(self) -> int:
        return self._field0 + self.fields

    @property
    def _key0(self) -> int:
        return self._note0 + self.n_notes

    @property
    def _value0(self) -> int:
        return self._key0 + self.n_keys

    @property
    def n_notes(self) -> int:
        return 16

    @property
    def vocab_size(self) -> int:
        return self._value0 + self.n_keys * self.fields * self.value_len * self.choices

    # ---- lengths ------------------------------------------------------------------------------------
    @property
    def prompt_len(self) -> int:
        return 1 + self.system_len + 3

    @property
    def reply_len(self) -> int:
        return self.reply_text + self.value_len + 4

    @property
    def turn1_len(self) -> int:
        return self.note_len + 3

    @property
    def response_len(self) -> int:
        """Tokens of a well-formed response: turn 1, the reply, the answer and EOS."""
        return self.turn1_len + self.reply_len + self.value_len + 1

    @property
    def prefix_ratio(self) -> float:
        return self.prompt_len / (self.prompt_len + self.response_len)

    def max_response_len(self, max_new_tokens: int) -> int:
        """The longest response: two policy turns of ``max_new_tokens`` and the longest reply."""
        return 2 * max_new_tokens + self.reply_len

    # ---- episodes and the tool ----------------------------------------------------------------------
    def system_prompt(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(_SYSTEM_SEED)
        return self._note0 + torch.randint(0, self.n_notes, (self.system_len,), generator=gen)

    def example(self, seed: int, index: int) -> Episode:
        """Question ``index`` of the stream ``seed``."""
        gen = torch.Generator().manual_seed((seed * 1_000_003 + index) % (2**63))
        f_all, length = self.fields, self.value_len
        picks = torch.randint(0, self.choices, (self.n_keys, f_all, length), generator=gen)
        slots = (
            torch.arange(self.n_keys).view(-1, 1, 1) * f_all * length
            + torch.arange(f_all).view(1, -1, 1) * length
            + torch.arange(length).view(1, 1, -1)
        )
        values = self._value0 + slots * self.choices + picks
        texts = self._note0 + torch.randint(
            0, self.n_notes, (self.n_keys, f_all, self.reply_text), generator=gen
        )
        key = int(torch.randint(0, self.n_keys, (1,), generator=gen))
        field = int(torch.randint(0, f_all, (1,), generator=gen))
        prompt = torch.cat(
            [
                torch.tensor([BOS]),
                self.system_prompt(),
                torch.tensor([QUERY, self._key0 + key, self._field0 + field]),
            ]
        )
        return Episode(prompt, values, texts, key, field, values[key, field].clone())

    def parse_call(self, turn1: torch.Tensor) -> tuple[int, int] | None:
        """(key, field) of a turn 1 ending ``k F CALL``, else None."""
        t = turn1.tolist()
        if len(t) < 3 or t[-1] != CALL:
            return None
        key, field = t[-3] - self._key0, t[-2] - self._field0
        return (key, field) if 0 <= key < self.n_keys and 0 <= field < self.fields else None

    def tool(self, episode: Episode, turn1: torch.Tensor) -> torch.Tensor:
        """The tool's reply to a turn 1 (deterministic): the called value, else ERROR."""
        call = self.parse_call(turn1)
        if call is None:
            return torch.tensor([RESULT, ERROR, END])
        key, field = call
        head = torch.tensor([RESULT, self._key0 + key, self._field0 + field])
        return torch.cat([head, episode.texts[key, field], episode.values[key, field], torch.tensor([END])])

    def call_of(self, episode: Episode) -> torch.Tensor:
        """The right call (without the note)."""
        return torch.tensor([self._key0 + episode.key, self._field0 + episode.field, CALL])

    def reward(self, answer: torch.Tensor, episode: Episode) -> float:
        """Fraction of answer positions right, over turn 2 up to (without) its first EOS."""
        resp = answer.tolist()
        if EOS in resp:
            resp = resp[: resp.index(EOS)]
        target = episode.answer.tolist()
        return sum(a == b for a, b in zip(resp, target, strict=False)) / max(len(target), len(resp))

    # ---- rollouts -----------------------------------------------------------------------------------
    @torch.no_grad()
    def rollout(
        self,
        model: nn.Module,
        episode: Episode,
        answers: int,
        *,
        max_new_tokens: int,
        temperature: float,
        generator: torch.Generator | None,
    ) -> MultiTurnRollout:
        """``self.calls`` turn-1 samples, the tool's reply to each, then ``answers`` turn-2 samples after
        each (KV-cached, ``prefixflow.rl.sample_responses``; the noise from ``generator``, in this order)."""
        from prefixflow.rl import sample_responses

        device = next(model.parameters()).device
        first = sample_responses(
            model, episode.prompt, self.calls, max_new_tokens=max_new_tokens, eos_id=CALL,
            temperature=temperature, generator=generator,
        )  # fmt: skip
        out = MultiTurnRollout([], [], [], [], [])
        for turn1, cut1 in zip(first.responses, first.truncated, strict=True):
            turn1 = turn1.cpu()
            reply = self.tool(episode, turn1)
            context = torch.cat([episode.prompt, turn1, reply])
            second = sample_responses(
                model, context.to(device), answers, max_new_tokens=max_new_tokens, eos_id=EOS,
                temperature=temperature, generator=generator,
            )  # fmt: skip
            ok = self.parse_call(turn1) == (episode.key, episode.field)
            for turn2, cut2 in zip(second.responses, second.truncated, strict=True):
                turn2 = turn2.cpu()
                out.responses.append(torch.cat([turn1, reply, turn2]))
                out.loss_masks.append(
                    torch.cat(
                        [
                            torch.ones(turn1.numel(), dtype=torch.bool),
                            torch.zeros(reply.numel(), dtype=torch.bool),
                            torch.ones(turn2.numel(), dtype=torch.bool),
                        ]
                    )
                )
                out.answers.append(turn2)
                out.truncated.append(bool(cut1 or cut2))
                out.call_ok.append(bool(ok))
        return out

    # ---- warm start and its reward ------------------------------------------------------------------
    def episode_tokens(self, episode: Episode, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """A well-formed episode (a uniform note, the right call, its reply, the answer and EOS) and the
        mask of its trained positions (turn 1 and turn 2)."""
        note = self._note0 + torch.randint(0, self.n_notes, (self.note_len,), generator=gen)
        turn1 = torch.cat([note, self.call_of(episode)])
        reply = self.tool(episode, turn1)
        turn2 = torch.cat([episode.answer, torch.tensor([EOS])])
        seq = torch.cat([episode.prompt, turn1, reply, turn2])
        mask = torch.zeros(seq.numel(), dtype=torch.bool)
        p = episode.prompt.numel()
        mask[p : p + turn1.numel()] = True
        mask[-turn2.numel() :] = True
        return seq, mask


def warm_start(
    model: nn.Module,
    task: MultiTurnTask,
    *,
    steps: int,
    batch: int,
    lr: float,
    seed: int,
    label_smoothing: float = 0.0,
    compute_dtype: torch.dtype | None = None,
) -> list[float]:
    """Supervised warm start: ``steps`` AdamW steps of cross-entropy on the policy's tokens of well-formed
    episodes, ``batch`` a step, from the stream ``seed``. Returns the losses."""
    gen = torch.Generator().manual_seed(seed)
    return train_supervised(
        model,
        lambda i: task.episode_tokens(task.example(seed, i), gen),
        steps=steps,
        batch=batch,
        lr=lr,
        compute_dtype=compute_dtype,
        label_smoothing=label_smoothing,
    )


@torch.no_grad()
def mean_reward(
    model: nn.Module,
    task: MultiTurnTask,
    *,
    prompts: int,
    n: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
) -> tuple[float, float]:
    """(mean reward, exact-match rate) of ``n`` sampled paths (``task.calls`` calls x ``n // calls``
    answers) to each of ``prompts`` questions of the stream ``seed``."""
    device = next(model.parameters()).device
    gen = torch.Generator(device).manual_seed(seed)
    rewards = []
    for i in range(prompts):
        ep = task.example(seed, i)
        ro = task.rollout(
            model, ep, n // task.calls, max_new_tokens=max_new_tokens, temperature=temperature, generator=gen
        )
        rewards += [task.reward(a, ep) for a in ro.answers]
    return sum(rewards) / len(rewards), sum(r == 1.0 for r in rewards) / len(rewards)
