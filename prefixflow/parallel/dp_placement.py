"""Data-parallel placement: a FLOP cost per rollout group (or prefix tree) and longest-processing-time
placement of a step's groups on the DP ranks, splitting the largest group when whole groups leave a rank too
far above the mean (paper §4.7; trees stay whole). Used by :func:`prefixflow.parallel.dp.train_step`."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..group import RolloutGroup
from ..model.models import head_dim_of, hidden_dim_of, model_args
from ..tree.plan import TreeRows, group_tree
from ..tree.rollout_tree import RolloutTree

__all__ = ["Work", "Placement", "group_costs", "place_groups"]


# -- cost model ----------------------------------------------------------------------------------------
class _RowCost:
    """FLOPs (forward + backward = 3x forward) of one row: ``n`` tokens after ``before`` cached keys, scoring
    ``scored`` tokens. Per layer a token costs its projections and MLP, every (query, key) pair it attends
    the two attention matmuls; each scored token pays the LM head."""

    def __init__(self, model: nn.Module) -> None:
        dim, n_layers, nq, nkv, hd, hidden, vocab = _dims(model)
        self.per_token = n_layers * (2 * dim * hd * (2 * nq + 2 * nkv) + 6 * dim * hidden)
        self.per_pair = n_layers * 4 * nq * hd
        self.head = 2 * dim * vocab

    def __call__(self, n: int, before: int, scored: int) -> float:
        pairs = n * before + n * (n + 1) / 2
        return 3.0 * (self.per_token * n + self.per_pair * pairs + self.head * scored)


def _dims(model: nn.Module) -> tuple[int, int, int, int, int, int, int]:
    """``(dim, layers, q heads, kv heads, head dim, FFN hidden, vocab)`` of a TorchTitan model (its ModelArgs)
    or of a transformers model (its ``config``; a hybrid's layers are all costed as attention + MLP, which is
    enough to place groups by relative cost)."""
    if getattr(model, "model_args", None) is not None:
        args = model_args(model)
        nq = args.n_heads
        return (args.dim, args.n_layers, nq, args.n_kv_heads or nq, head_dim_of(args), hidden_dim_of(args),
                args.vocab_size)  # fmt: skip
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg  # a multimodal config wraps the text model's
    try:
        dim, nq = cfg.hidden_size, cfg.num_attention_heads
        nkv = getattr(cfg, "num_key_value_heads", None) or nq
        hd = getattr(cfg, "head_dim", None) or dim // nq
        return dim, cfg.num_hidden_layers, nq, nkv, hd, cfg.intermediate_size, cfg.vocab_size
    except AttributeError as e:
        raise TypeError(
            f"{type(model).__name__}: DP placement costs a TorchTitan model (.model_args) or a transformers "
            f"model (.config with hidden_size, num_attention_heads, num_hidden_layers, intermediate_size, "
            f"vocab_size); {e}"
        ) from None


def group_costs(
    model: nn.Module, group: RolloutGroup | RolloutTree, system: str
) -> tuple[float, list[float]]:
    """``(prefix_cost, response_costs)`` in FLOPs of training ``group`` (a tree: ``(cached nodes' cost,
    path costs)``). PrefixFlow pays the prefix (each cached node) once (``prefix_cost``); the baseline pays it
    in every sequence (``prefix_cost`` is 0)."""
    if system not in ("prefixflow", "baseline"):
        raise ValueError(f"system {system!r} unknown; valid: ('prefixflow', 'baseline')")
    row = _RowCost(model)
    tree = group_tree(group) if isinstance(group, RolloutGroup) else group
    rows = TreeRows(tree)
    if system == "baseline":
        return 0.0, [row(len(r), 0, len(r.cols)) for r in map(rows.full_row, range(tree.n))]
    nodes = sum(row(tree.node_len(j), tree.first_position[j], rows.scores(j)) for j in rows.cached)
    paths = [0.0] * tree.n
    for i, r in rows.leaf_rows.items():
        paths[i] = row(len(r), r.first_position, len(r.cols))
    return nodes, paths


# -- placement -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Work:
    """One rank's share of one group: ``responses`` it trains; ``owner`` runs Phase A/C; ``ranks`` hold
    parts of the group (one rank for a whole group)."""

    group: int
    responses: tuple[int, ...]
    owner: int
    ranks: tuple[int, ...]

    @property
    def split(self) -> bool:
        return len(self.ranks) > 1


@dataclass
class Placement:
    """Per DP rank: its work in execution order (split groups first, in group order, then whole groups)."""

    work: list[list[Work]]
    loads: list[float]
    split_groups: tuple[int, ...]

    @property
    def imbalance(self) -> float:
        """Busiest rank over the mean load, minus one (0 = perfectly balanced)."""
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean - 1.0 if mean > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "work": [[(w.group, list(w.responses), w.owner) for w in ws] for ws in self.work],
            "loads": self.loads,
            "split_groups": list(self.split_groups),
        }


def _imbalance(loads: list[float]) -> float:
    mean = sum(loads) / len(loads)
    return max(loads) / mean - 1.0 if mean > 0 else 0.0


def place_groups(
    costs: list[tuple[float, list[float]]],
    n_ranks: int,
    split_threshold: float | None = 0.25,
    whole: set[int] | frozenset[int] = frozenset(),
) -> Placement:
    """Longest-processing-time placement of whole groups, then the split fallback.

    ``costs``: per group ``(prefix_cost, response_costs)``; ``whole``: groups never split (prefix trees).
    While the busiest rank is more than
    ``split_threshold`` above the mean load (None: never split), the largest unsplit group with two or more
    responses is split: its owner (the least-loaded rank without it) pays the prefix, and its responses go,
    largest first, to the least-loaded ranks. A split that does not lower the imbalance is undone and the
    search stops. Deterministic: every rank computes the same placement.
    """
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    if split_threshold is not None and split_threshold < 0:
        raise ValueError(f"split_threshold must be >= 0 or None, got {split_threshold}")
    total = [p + sum(r) for p, r in costs]
    order = sorted(range(len(costs)), key=lambda g: (-total[g], g))
    shares: dict[int, dict[int, list[int]]] = {}  # group -> rank -> responses
    owner: dict[int, int] = {}
    loads = [0.0] * n_ranks
    for g in order:
        r = min(range(n_ranks), key=lambda i: (loads[i], i))
        loads[r] += total[g]
        shares[g] = {r: list(range(len(costs[g][1])))}
        owner[g] = r
    split: list[int] = []
    while split_threshold is not None and n_ranks > 1 and _imbalance(loads) > split_threshold:
        candidates = [g for g in order if g not in split and g not in whole and len(costs[g][1]) > 1]
        if not candidates:
            break
        g = candidates[0]
        before = (list(loads), shares[g], owner[g])
        loads[owner[g]] -= total[g]
        prefix, resp = costs[g]
        new_owner = min(range(n_ranks), key=lambda i: (loads[i], i))
        loads[new_owner] += prefix
        parts: dict[int, list[int]] = {new_owner: []}
        for i in sorted(range(len(resp)), key=lambda i: (-resp[i], i)):
            r = min(range(n_ranks), key=lambda k: (loads[k], k))
            loads[r] += resp[i]
            parts.setdefault(r, []).append(i)
        if _imbalance(loads) >= _imbalance(before[0]) or len(parts) == 1:
            loads, shares[g], owner[g] = before
            break
        shares[g] = {r: sorted(v) for r, v in parts.items()}
        owner[g] = new_owner
        split.append(g)
    work: list[list[Work]] = [[] for _ in range(n_ranks)]
    for g in sorted(split) + sorted(set(range(len(costs))) - set(split)):
        ranks = tuple(sorted(shares[g]))
        for r in ranks:
            work[r].append(Work(g, tuple(shares[g][r]), owner[g], ranks))
    return Placement(work, loads, tuple(sorted(split)))
