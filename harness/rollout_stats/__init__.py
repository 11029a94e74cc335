"""A user's own rollouts measured the paper's way (Table 1): prefix ratios, group sizes and the tokens a shared
prefix or a prefix trie saves (``pf-bench workload``, docs/workload.md). Not :mod:`harness.workloads`, which
generates synthetic tree shapes."""

from harness.rollout_stats.read import (
    LAYOUTS,
    MAX_BYTES,
    MAX_ROWS,
    Group,
    RolloutError,
    Rollouts,
    read_rollouts,
)
from harness.rollout_stats.stats import PERCENTILES, WorkloadStats, representative, workload_stats

__all__ = [
    "LAYOUTS",
    "MAX_BYTES",
    "MAX_ROWS",
    "PERCENTILES",
    "Group",
    "RolloutError",
    "Rollouts",
    "WorkloadStats",
    "read_rollouts",
    "representative",
    "workload_stats",
]
