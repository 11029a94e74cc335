"""A tiny Claim-2 spec shared by the RL tests (dim 32, 2 layers, 27-token prompts, 3 steps)."""

from __future__ import annotations

from harness.rl.spec import parse_rl_spec

TINY_SPEC = {
    "name": "tiny",
    "model": {
        "name": "llama3:debugmodel",
        "overrides": {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 128},
    },
    "task": {"prefix_ratio": 0.9, "value_len": 2, "choices": 3},
    "warm_start": {"steps": 2, "batch": 4, "passages": 2, "eval_prompts": 2},
    "loop": {"steps": 3, "prompts_per_step": 2, "n": 3, "max_new_tokens": 4, "lr": 1e-3},
    "trainers": ["baseline", "prefixflow"],
    "reference_seed": None,
    "checkpoint_every": 1,
    "trace": None,
    "claim3_reference": {"enabled": False},
    "device": "cpu",
}


# The multi-rank loop tests' spec (tests/harness/rl/test_rl_ranks.py, tests/harness/rl/test_rl_slurm.py): a 40-step warm start and
# 2 answer choices, so that rewards vary within a group and the weights move from the first step.
RANKS_SPEC = {
    "model": TINY_SPEC["model"],
    "task": {"prefix_ratio": 0.9, "value_len": 2, "choices": 2},
    "warm_start": {"steps": 40, "batch": 8, "lr": 3e-3, "passages": 3, "eval_prompts": 2},
    "loop": {"steps": 3, "prompts_per_step": 3, "n": 4, "max_new_tokens": 4, "lr": 1e-3},
    "device": "cpu",
}


def tiny_spec(**changes):
    raw = {**TINY_SPEC, **changes}
    return parse_rl_spec(raw)
