"""Tree workloads: seeded generators of the rollout shapes that drive prefix trees (issue 22).

Each shape is a pydantic model (a spec's ``axes.trees`` entry) whose :meth:`generate` returns a
:class:`Workload`: N unpadded token sequences, their loss masks (True = trained) and advantages, the input
``prefixflow.build_tree`` takes, plus the shape's token statistics. Tokens are uniform over the vocabulary from
a ``torch.Generator`` seeded with ``seed``; every draw is deterministic.

- ``agentic``: a system prompt with tool schemas (no loss), then ``turns`` turns, each an assistant turn
  (loss) and a tool/user reply (no loss); at each turn in ``branch_at`` the assistant turn is resampled
  ``branch`` times and every branch continues on its own.
- ``search``: a prompt (no loss) and a tree of depth ``depth``, ``branch`` children per node, each a segment of
  ``segment_len`` trained tokens.
- ``shared_context``: one context (a RAG document or system prompt, no loss), ``prompts`` prompts over it (no
  loss), ``responses`` responses per prompt (loss): a two-level tree.
- ``flat``: one prompt and ``n`` responses, as a flat GRPO group (the regression line).

Statistics: ``path_tokens`` = sum of the sequences' lengths, ``unique_tokens`` = tokens of their trie (each
shared run once), ``shared_fraction`` = 1 - unique / path tokens, ``levels`` = nodes on the longest path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["TreeShape", "Workload", "AgenticShape", "SearchShape", "SharedContextShape", "FlatShape"]

Len = Annotated[int, Field(ge=1, le=1_000_000)]
Small = Annotated[int, Field(ge=1, le=64)]


@dataclass
class Workload:
    sequences: list[torch.Tensor]
    loss_masks: list[torch.Tensor]
    advantages: torch.Tensor
    label: str

    def tree(self, min_shared_tokens: int | str = 1):
        """The rollouts as a ``prefixflow.RolloutTree`` (a compressed trie)."""
        from prefixflow import build_tree

        return build_tree(
            self.sequences, self.advantages, loss_masks=self.loss_masks, min_shared_tokens=min_shared_tokens
        )

    def stats(self) -> dict[str, float | int]:
        tree = self.tree()
        path = sum(int(s.numel()) for s in self.sequences)
        levels = max(len(tree.path_nodes(i)) for i in range(tree.n))
        return {
            "paths": tree.n,
            "path_tokens": path,
            "unique_tokens": tree.unique_tokens,
            "unique_ratio": tree.unique_tokens / path,
            "shared_fraction": 1.0 - tree.unique_tokens / path,
            "trained_tokens": sum(int(m.sum()) for m in self.loss_masks),
            "nodes": tree.n_nodes,
            "levels": levels,
            "trunk_len": tree.node_len(tree.path_nodes(0)[0]),
            "max_path_len": max(int(s.numel()) for s in self.sequences),
        }


class _Shape(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)
    seed: int = Field(0, ge=0, le=2**32 - 1)

    def _draw(self, vocab: int):
        gen = torch.Generator().manual_seed(self.seed)
        return lambda n: torch.randint(0, vocab, (n,), generator=gen), gen

    def _finish(self, paths: list[tuple[list[torch.Tensor], list[bool]]], gen) -> Workload:
        seqs, masks = [], []
        for parts, trained in paths:
            seqs.append(torch.cat(parts))
            masks.append(
                torch.cat([torch.full((p.numel(),), t) for p, t in zip(parts, trained, strict=True)])
            )
        adv = torch.randn(len(seqs), generator=gen, dtype=torch.float64)
        return Workload(seqs, masks, adv, self.label)


def _nominal(trunk: int, longest: int, paths: int) -> tuple[int, int, int]:
    return trunk, max(1, longest - trunk), paths


class AgenticShape(_Shape):
    kind: Literal["agentic"] = "agentic"
    system_len: Len = 256
    turns: Small = 3
    assistant_len: Len = 32
    reply_len: Len = 32
    branch: Small = 2
    branch_at: list[Annotated[int, Field(ge=0, le=63)]] = Field(default_factory=lambda: [0, 1, 2])

    @model_validator(mode="after")
    def _branch_points(self) -> AgenticShape:
        if len(set(self.branch_at)) != len(self.branch_at):
            raise ValueError(f"branch_at {self.branch_at} repeats a turn; list each turn once")
        beyond = [t for t in self.branch_at if t >= self.turns]
        if beyond and "branch_at" in self.model_fields_set:
            raise ValueError(
                f"branch_at {beyond} names turns beyond the {self.turns} turns (0 .. {self.turns - 1}); drop them or "
                "raise turns"
            )
        return self  # the default [0, 1, 2] under fewer turns branches at the turns that exist

    @property
    def label(self) -> str:
        at = "".join(map(str, self.branch_at)) or "-"
        return (
            f"agentic s{self.system_len} t{self.turns} a{self.assistant_len} r{self.reply_len} "
            f"b{self.branch}@{at}"
        )

    def nominal(self) -> tuple[int, int, int]:
        """(shared trunk, longest path minus the trunk, paths) from the parameters alone."""
        at = sorted(t for t in set(self.branch_at) if t < self.turns)
        trunk = self.system_len + (at[0] if at else self.turns) * (self.assistant_len + self.reply_len)
        longest = self.system_len + self.turns * (self.assistant_len + self.reply_len)
        return _nominal(trunk, longest, self.branch ** len(at))

    def generate(self, vocab: int) -> Workload:
        draw, gen = self._draw(vocab)
        out: list[tuple[list[torch.Tensor], list[bool]]] = []

        def turn(t: int, parts: list[torch.Tensor], trained: list[bool]) -> None:
            if t == self.turns:
                out.append((parts, trained))
                return
            for _ in range(self.branch if t in self.branch_at else 1):
                turn(t + 1, [*parts, draw(self.assistant_len), draw(self.reply_len)], [*trained, True, False])

        turn(0, [draw(self.system_len)], [False])
        return self._finish(out, gen)


class SearchShape(_Shape):
    kind: Literal["search"] = "search"
    prompt_len: Len = 128
    depth: Small = 3
    branch: Small = 2
    segment_len: Len = 32

    @property
    def label(self) -> str:
        return f"search p{self.prompt_len} d{self.depth} b{self.branch} seg{self.segment_len}"

    def nominal(self) -> tuple[int, int, int]:
        return _nominal(
            self.prompt_len, self.prompt_len + self.depth * self.segment_len, self.branch**self.depth
        )

    def generate(self, vocab: int) -> Workload:
        draw, gen = self._draw(vocab)
        out: list[tuple[list[torch.Tensor], list[bool]]] = []

        def grow(d: int, parts: list[torch.Tensor], trained: list[bool]) -> None:
            if d == self.depth:
                out.append((parts, trained))
                return
            for _ in range(self.branch):
                grow(d + 1, [*parts, draw(self.segment_len)], [*trained, True])

        grow(0, [draw(self.prompt_len)], [False])
        return self._finish(out, gen)


class SharedContextShape(_Shape):
    kind: Literal["shared_context"] = "shared_context"
    context_len: Len = 512
    prompts: Small = 4
    prompt_len: Len = 32
    responses: Small = 4
    response_len: Len = 32

    @property
    def label(self) -> str:
        return (
            f"shared_context c{self.context_len} k{self.prompts} p{self.prompt_len} "
            f"n{self.responses} r{self.response_len}"
        )

    def nominal(self) -> tuple[int, int, int]:
        longest = self.context_len + self.prompt_len + self.response_len
        return _nominal(self.context_len, longest, self.prompts * self.responses)

    def generate(self, vocab: int) -> Workload:
        draw, gen = self._draw(vocab)
        context = draw(self.context_len)
        out = []
        for _ in range(self.prompts):
            prompt = draw(self.prompt_len)
            out += [
                ([context, prompt, draw(self.response_len)], [False, False, True])
                for _ in range(self.responses)
            ]
        return self._finish(out, gen)


class FlatShape(_Shape):
    kind: Literal["flat"] = "flat"
    prompt_len: Len = 256
    n: Small = 8
    response_len: Len = 64

    @property
    def label(self) -> str:
        return f"flat p{self.prompt_len} n{self.n} r{self.response_len}"

    def nominal(self) -> tuple[int, int, int]:
        return _nominal(self.prompt_len, self.prompt_len + self.response_len, self.n)

    def generate(self, vocab: int) -> Workload:
        draw, gen = self._draw(vocab)
        prompt = draw(self.prompt_len)
        return self._finish([([prompt, draw(self.response_len)], [False, True]) for _ in range(self.n)], gen)


TreeShape = Annotated[
    AgenticShape | SearchShape | SharedContextShape | FlatShape, Field(discriminator="kind")
]
