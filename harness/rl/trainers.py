"""The Claim-2 trainers: what each one hands ``prefixflow.rl.actor_update`` for a step's rollout groups.

All three train the same objective (the same paths, loss masks, advantages and log-probs; exact in fp64,
``tests/harness/rl/test_rl_multiturn.py``), so their speed is compared on equal answers:

- ``baseline``: every path ``[prompt || response]`` a full sequence (``system="baseline"``);
- ``prefixflow`` (flat): today's PrefixFlow, the group's longest common prefix computed once and every
  path's remainder a suffix (for a group without loss masks: the group as it is, its prompt the prefix;
  with masks: ``harness.peers.tree_flat.flatten_tree`` of its tree, the ``prefixflow_flat`` peer);
- ``prefixflow_tree``: the group's prefix tree (``prefixflow.build_tree`` over its paths,
  ``min_shared_tokens="auto"``): every shared run that pays its node cost, e.g. a turn-1 call and its tool
  reply under several answers, computed once. The ``auto`` rule matters in a loop: sampled answers share
  short prefixes (a first token, an identical answer), and with ``min_shared_tokens=1`` each becomes a node
  of its own whose fixed cost exceeds the tokens it saves (``docs/trees-practice.md``, the multi-turn loop).

Building the tree is part of the tree trainers' work: the loop calls :func:`trainer_inputs` inside the timed
update.
"""

from __future__ import annotations

import torch

import prefixflow as pf
from harness.peers.tree_flat import flatten_tree

__all__ = ["TRAINERS", "system_of", "group_tree", "trainer_inputs"]

TRAINERS = {"baseline": "baseline", "prefixflow": "prefixflow", "prefixflow_tree": "prefixflow"}
TREE_MIN_SHARED = "auto"  # the tree trainer's build_tree rule (prefixflow.tree.build.AUTO_NODE_COST_TOKENS)


def system_of(trainer: str) -> str:
    """The ``train_group`` system a trainer runs (ValueError naming the valid trainers)."""
    try:
        return TRAINERS[trainer]
    except KeyError:
        raise ValueError(f"trainer {trainer!r} unknown; valid: {', '.join(TRAINERS)}") from None


def group_tree(group: pf.RolloutGroup, min_shared_tokens: int | str = 1) -> pf.RolloutTree:
    """The prefix tree of ``group``'s paths ``[prompt || response_i]`` (``build_tree``'s
    ``min_shared_tokens``): the prompt and untrained (masked) response tokens carry no loss, log-probs are
    zero-padded over the prompt."""
    p = group.prompt_len
    prompt = group.prompt
    masks = group.loss_masks or [torch.ones(n, dtype=torch.bool) for n in group.response_lens]
    zeros = torch.zeros(p, dtype=torch.bool, device=prompt.device)

    def whole(values):
        return None if values is None else [torch.cat([v.new_zeros(p), v]) for v in values]

    return pf.build_tree(
        [torch.cat([prompt, r]) for r in group.responses],
        group.advantages,
        [torch.cat([zeros, m.to(prompt.device)]) for m in masks],
        old_logprobs=whole(group.old_logprobs),
        ref_logprobs=whole(group.ref_logprobs),
        min_shared_tokens=min_shared_tokens,
    )


def trainer_inputs(trainer: str, groups: list[pf.RolloutGroup]) -> tuple[str, list]:
    """(``system``, the groups or trees) ``actor_update`` trains for ``trainer``."""
    system = system_of(trainer)
    if trainer == "baseline":
        return system, groups
    if trainer == "prefixflow":
        return system, [g if g.loss_masks is None else flatten_tree(group_tree(g)) for g in groups]
    return system, [group_tree(g, TREE_MIN_SHARED) for g in groups]
