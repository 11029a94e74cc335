"""The paper's Table 1 statistics of a set of rollout groups (§2: the prefix ratio ``|P|/(|P|+|S|)`` per
sample, aggregated into percentiles), and the tokens a shared-prefix schedule trains.

* A sample's prefix ``P`` is its prompt (the input fixed before generation) where the file says where the
  prompt ends; in the ``sequences`` layout it is the longest common prefix of its group's sequences (a group
  of one sample has no measurable prefix: ``P = 0``). ``S`` is the rest of the sample.
* ``baseline_tokens``: every sample's full sequence, ``Σ (P + S)``.
* ``shared_tokens``: each group's common prefix once plus every sample's remainder (PrefixFlow's
  ``RolloutGroup``: one prompt, N responses). The common prefix is the longest common prefix of the group's
  prompts (of its sequences in the ``sequences`` layout).
* ``tree_tokens``: the distinct prefixes of each group's sequences, i.e. the nodes of a token trie over them
  (``prefixflow.build_tree``'s tokens: shared turns of multi-turn paths and partly shared prompts count once).
  Computed as ``Σ len - Σ lcp`` over the group's sequences in sorted order. A *tree group* is one whose trie
  holds fewer tokens than its flat sharing.

Percentiles are numpy's default (linear interpolation between order statistics).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from harness.rollout_stats.read import Rollouts

__all__ = ["WorkloadStats", "workload_stats", "representative", "common_prefix", "trie_tokens", "PERCENTILES"]

PERCENTILES = (10, 25, 50, 75, 90)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the longest common prefix of two token sequences."""
    m = min(len(a), len(b))
    differ = np.flatnonzero(a[:m] != b[:m])
    return int(differ[0]) if len(differ) else m


def group_prefix(seqs: list[np.ndarray]) -> int:
    """The longest prefix that every sequence of ``seqs`` starts with."""
    first, n = seqs[0], len(seqs[0])
    for s in seqs[1:]:
        n = common_prefix(first[:n], s)
    return n


def trie_tokens(seqs: list[np.ndarray]) -> int:
    """The nodes of a token trie over ``seqs``: each distinct prefix once (sorted order: a sequence's new
    tokens are those past its longest common prefix with its predecessor)."""
    order = sorted(seqs, key=lambda s: s.astype(">u4").tobytes())  # big-endian: byte order = token order
    total = len(order[0])
    for prev, cur in zip(order, order[1:], strict=False):
        total += len(cur) - common_prefix(prev, cur)
    return total


def _summary(values: np.ndarray) -> dict[str, float]:
    pct = np.percentile(values, PERCENTILES)
    return {
        "mean": float(values.mean()),
        **{f"p{q}": float(v) for q, v in zip(PERCENTILES, pct, strict=True)},
        "min": float(values.min()),
        "max": float(values.max()),
    }


@dataclass(frozen=True)
class WorkloadStats:
    layout: str
    samples: int
    groups: int
    singleton_groups: int
    tree_groups: int
    prefix_ratio: dict[str, float]
    prefix_len: dict[str, float]
    suffix_len: dict[str, float]
    group_size: dict[str, float]
    baseline_tokens: int
    shared_tokens: int
    tree_tokens: int

    @property
    def shared_fraction(self) -> float:
        """The fraction of the baseline's tokens a flat shared prefix saves."""
        return 1.0 - self.shared_tokens / self.baseline_tokens

    @property
    def tree_shared_fraction(self) -> float:
        """The fraction of the baseline's tokens the token trie saves."""
        return 1.0 - self.tree_tokens / self.baseline_tokens

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "shared_fraction": self.shared_fraction,
            "tree_shared_fraction": self.tree_shared_fraction,
        }


def workload_stats(rollouts: Rollouts) -> WorkloadStats:
    """The statistics of ``rollouts`` (see the module doc)."""
    prefixes, lengths, sizes = [], [], []
    baseline = shared = tree = singletons = trees = 0
    for g in rollouts.groups:
        lens = [len(s) for s in g.seqs]
        if g.prompt_lens is None:
            common = group_prefix(g.seqs) if len(g.seqs) > 1 else 0
            own = [common] * len(g.seqs)
        else:
            own = g.prompt_lens
            common = min(group_prefix(g.seqs), min(own))  # the prompts' common prefix
        flat = common + sum(n - common for n in lens)
        nodes = trie_tokens(g.seqs)
        prefixes += own
        lengths += lens
        sizes.append(len(g.seqs))
        baseline += sum(lens)
        shared += flat
        tree += nodes
        singletons += len(g.seqs) == 1
        trees += nodes < flat
    p, n = np.asarray(prefixes, dtype=np.float64), np.asarray(lengths, dtype=np.float64)
    return WorkloadStats(
        layout=rollouts.layout,
        samples=len(lengths),
        groups=len(sizes),
        singleton_groups=singletons,
        tree_groups=trees,
        prefix_ratio=_summary(p / n),
        prefix_len=_summary(p),
        suffix_len=_summary(n - p),
        group_size=_summary(np.asarray(sizes, dtype=np.float64)),
        baseline_tokens=baseline,
        shared_tokens=shared,
        tree_tokens=tree,
    )


def representative(stats: WorkloadStats) -> tuple[int, int, int]:
    """The one cell an estimate runs for this workload: the median prefix length, the median suffix length
    and the median group size, each rounded half up and at least 1."""

    def half_up(x: float) -> int:
        return max(1, int(np.floor(x + 0.5)))

    return (
        half_up(stats.prefix_len["p50"]),
        half_up(stats.suffix_len["p50"]),
        half_up(stats.group_size["p50"]),
    )
