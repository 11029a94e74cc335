"""A synthetic retrieval (RAG) task with a verifiable reward and a long shared prompt.

The prompt holds ``n_passages`` key -> value passages and ends with a question naming one key::

    BOS  k_1 v_11 .. v_1L SEP  k_2 v_21 .. v_2L SEP  ...  k_M v_M1 .. v_ML SEP  QUERY k_q

and the answer is that key's value ``v_q1 .. v_qL`` followed by EOS. Answers are *typed*: the j-th value token
of key k is one of ``choices`` tokens that belong to (k, j) alone (as a question's answer type restricts its
answer: a year, a name), and the prompt decides which one. A policy that knows the types but does not read
the passages scores ``1 / choices``; reading the right passage scores 1. The reward is the fraction of answer
positions right, ``#{i < L : resp[i] == v_qi} / max(L, len(resp))`` over the response up to its EOS: a
token-level analogue of MuSiQue's answer F1, in [0, 1].

It is the paper's setting in miniature: a long fixed context (the retrieved passages) per prompt, a short
generated answer, a prefix ratio near 0.95. MuSiQue composes 2-4 single-hop questions over 20 Wikipedia
paragraphs; here one hop over synthetic passages, small enough for a tiny model on a CPU.

``warm_start`` trains supervised on the same task with *few* passages (a short context, quick to learn):
the lookup transfers only partly to the long RL prompts, so GRPO starts well above the guessing level and
below the ceiling, and has something to learn within ~100 steps.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RetrievalTask", "warm_start", "mean_reward", "PAD", "BOS", "EOS", "SEP", "QUERY", "N_SPECIAL"]

PAD, BOS, EOS, SEP, QUERY = 0, 1, 2, 3, 4
N_SPECIAL = 5


@dataclass(frozen=True)
class RetrievalTask:
    """``n_passages`` passages, each one key token and ``value_len`` value tokens; keys are distinct within a
    prompt, drawn from ``n_keys`` symbols; each value position of each key has ``choices`` possible tokens."""

    n_passages: int
    value_len: int
    n_keys: int
    choices: int = 4

    def __post_init__(self) -> None:
        for name in ("n_passages", "value_len", "n_keys", "choices"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"task.{name} must be an int >= 1, got {value!r}")
        if self.n_passages > self.n_keys:
            raise ValueError(f"task.n_keys ({self.n_keys}) must be >= n_passages ({self.n_passages})")

    @classmethod
    def for_prefix_ratio(
        cls, prefix_ratio: float, value_len: int, n_keys: int | None = None, choices: int = 4
    ) -> RetrievalTask:
        """The task whose prefix ratio ``P / (P + L + 1)`` is closest to ``prefix_ratio`` (at least 2
        passages); ``n_keys`` defaults to the passage count (every key in every prompt, in random order)."""
        if not 0.0 < prefix_ratio < 1.0:
            raise ValueError(f"prefix_ratio must be in (0, 1), got {prefix_ratio}")
        prompt = prefix_ratio / (1.0 - prefix_ratio) * (value_len + 1)
        passages = max(2, round((prompt - 3) / (value_len + 2)))
        return cls(passages, value_len, n_keys or passages, choices)

    def with_passages(self, n_passages: int) -> RetrievalTask:
        """The same symbols with another passage count (the warm start's short context)."""
        return dataclasses.replace(self, n_passages=n_passages)

    @property
    def vocab_size(self) -> int:
        return N_SPECIAL + self.n_keys + self.n_keys * self.value_len * self.choices

    @property
    def prompt_len(self) -> int:
        return 1 + self.n_passages * (self.value_len + 2) + 2

    @property
    def response_len(self) -> int:
        """Tokens of a correct response: the value and EOS."""
        return self.value_len + 1

    @property
    def prefix_ratio(self) -> float:
        return self.prompt_len / (self.prompt_len + self.response_len)

    def example(self, seed: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt ``index`` of the stream ``seed``: (prompt tokens, answer tokens without EOS)."""
        gen = torch.Generator().manual_seed((seed * 1_000_003 + index) % (2**63))
        m, length = self.n_passages, self.value_len
        keys = torch.randperm(self.n_keys, generator=gen)[:m]
        picks = torch.randint(0, self.choices, (m, length), generator=gen)
        slots = keys.view(m, 1) * length + torch.arange(length).view(1, length)
        values = N_SPECIAL + self.n_keys + slots * self.choices + picks
        asked = int(torch.randint(0, m, (1,), generator=gen))
        key_tokens = N_SPECIAL + keys
        body = torch.cat([key_tokens.view(m, 1), values, torch.full((m, 1), SEP)], dim=1).flatten()
        prompt = torch.cat([torch.tensor([BOS]), body, torch.tensor([QUERY, int(key_tokens[asked])])])
        return prompt, values[asked].clone()

    def reward(self, response: torch.Tensor, answer: torch.Tensor) -> float:
        """Fraction of answer positions right, over the response up to (without) its first EOS."""
        resp = response.tolist()
        if EOS in resp:
            resp = resp[: resp.index(EOS)]
        target = answer.tolist()
        hits = sum(a == b for a, b in zip(resp, target, strict=False))
        return hits / max(len(target), len(resp))


def warm_start(
    model: nn.Module,
    task: RetrievalTask,
    *,
    steps: int,
    batch: int,
    lr: float,
    seed: int,
    passages: int | None = None,
    compute_dtype: torch.dtype | None = None,
    label_smoothing: float = 0.0,
) -> list[float]:
    """Supervised warm start: ``steps`` AdamW steps of answer cross-entropy (the value and EOS; optional
    ``label_smoothing``) on ``batch`` prompts each of ``passages`` passages (default: the task's), from the
    stream ``seed``. Returns the losses."""
    short = task.with_passages(passages or task.n_passages)
    p = short.prompt_len

    def row(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        prompt, answer = short.example(seed, i)
        seq = torch.cat([prompt, answer, torch.tensor([EOS])])
        return seq, torch.arange(len(seq)) >= p  # the value and EOS

    return train_supervised(
        model,
        row,
        steps=steps,
        batch=batch,
        lr=lr,
        compute_dtype=compute_dtype,
        label_smoothing=label_smoothing,
    )


def train_supervised(
    model: nn.Module,
    row,
    *,
    steps: int,
    batch: int,
    lr: float,
    compute_dtype: torch.dtype | None = None,
    label_smoothing: float = 0.0,
) -> list[float]:
    """``steps`` AdamW steps of cross-entropy, each on ``batch`` rows ``row(i) -> (tokens, targets)`` (``targets``:
    a bool per token, True where the token is trained), ``i = step * batch + b``. Returns the losses; raises
    ``FloatingPointError`` at the first non-finite one (the warm starts of every Claim-2 task)."""
    from prefixflow.rl import autocast_for

    if steps < 0 or batch < 1:
        raise ValueError("warm_start needs steps >= 0 and batch >= 1")
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step in range(steps):
        rows = [row(step * batch + b) for b in range(batch)]
        seqs = torch.stack([s for s, _ in rows]).to(device)
        mask = torch.stack([m for _, m in rows])[:, 1:].to(device)
        opt.zero_grad(set_to_none=True)
        with autocast_for(device, compute_dtype):
            logits = model(seqs[:, :-1])
            loss = F.cross_entropy(logits[mask].float(), seqs[:, 1:][mask], label_smoothing=label_smoothing)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"warm start diverged at step {step} (loss {losses[-1]})")
    return losses


@torch.no_grad()
def mean_reward(
    model: nn.Module,
    task: RetrievalTask,
    *,
    prompts: int,
    n: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
) -> tuple[float, float]:
    """(mean reward, exact-match rate) of ``n`` sampled responses to each of ``prompts`` prompts of the
    stream ``seed`` (the warm-start level a GRPO run starts from)."""
    from prefixflow.rl import sample_responses

    device = next(model.parameters()).device
    gen = torch.Generator(device).manual_seed(seed)
    rewards = []
    for i in range(prompts):
        prompt, answer = task.example(seed, i)
        rollout = sample_responses(
            model,
            prompt,
            n,
            max_new_tokens=max_new_tokens,
            eos_id=EOS,
            temperature=temperature,
            generator=gen,
        )
        rewards += [task.reward(r.cpu(), answer) for r in rollout.responses]
    return sum(rewards) / len(rewards), sum(r == 1.0 for r in rewards) / len(rewards)
