"""FLOPs of one prefix tree (``prefixflow.RolloutTree``) as each system executes it, and the tree's ideal.

The counting rules are :mod:`harness.costmodel.flops`' (GEMMs 3x forward, attention pairs as each SDPA call
computes them: ``L(L+1)/2`` causal, every ``Lq·Lk`` pair under a mask). What runs (``prefixflow.schedule.tree_phases``):

* ``prefixflow``, Phase A/C per cached node (a node with children): one row of its ``n`` tokens after its
  ancestors' ``U`` cached keys (``U`` = the node's first position), every layer forward; causal when ``U = 0``,
  masked over ``n·(U + n)`` pairs otherwise; the LM head at the ``s`` trained tokens the node scores. Its
  backward starts at every layer's K/V and at those scores: with ``s > 0`` it runs everything back; with
  ``s = 0`` it never reaches the last layer's attention, ``wq``, ``wo`` or MLP (only its ``wk``/``wv``).
* ``prefixflow``, Phase B: the paths' leaf rows in microbatches (paths with no leaf token to score run none),
  one masked call per layer over the union ``K`` of the microbatch's ancestor keys and its own tokens:
  ``b·W·(K + W)`` padded, ``R·(K + R)`` packed (``R`` = its tokens).
* ``baseline``: every path but its last token as a full sequence, in microbatches of paths (causal padded,
  block-diagonal mask packed), as :func:`~harness.costmodel.flops.executed_flops` does for a flat group.

:func:`ideal_tree_flops` is the least work any schedule that trains every path must do: each of the trie's
unique tokens once through every layer forward and backward, causal pairs along each node's path only, the
LM head at each distinct scored position once. ``baseline / ideal`` is the unique-token ideal speedup.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixflow.tree.plan import TreePlan, TreeRow
from prefixflow.tree.rollout_tree import RolloutTree

from .flops import _trained, as_shape
from .hybrid import HybridShape
from .work import Flops
from .work import causal_pairs as _causal
from .work import microbatches as _chunks

__all__ = ["executed_tree_flops", "ideal_tree_flops"]


def _dense(shape):
    shape = as_shape(shape)
    if isinstance(shape, HybridShape):
        raise ValueError("the tree cost model covers dense decoders only, not hybrid models")
    return shape


def _rows_flops(shape, tree: RolloutTree, rows: list[TreeRow], layout: str) -> Flops:
    """One microbatch of ``rows`` as ``prefixflow.tree.plan.tree_microbatch`` lays it out."""
    keys = {j for r in rows for j in r.ancestors}
    k = sum(tree.node_len(j) for j in keys)
    lens = [int(r.tokens.numel()) for r in rows]
    scored = sum(len(r.cols) for r in rows)
    if layout == "packed":
        slots = sum(lens)
        pairs = slots * (k + slots)
    else:
        b, w = len(lens), max(lens)
        slots = b * w
        causal = k == 0 and all(r.first_position == 0 for r in rows)
        pairs = b * _causal(w) if causal else b * w * (k + w)
    return _trained(shape, slots, pairs, scored)


def _node_flops(shape, tree: RolloutTree, plan: TreePlan, j: int) -> Flops:
    n, before = tree.node_len(j), tree.first_position[j]
    scored = len(plan.scores[j][0])
    pairs = _causal(n) if before == 0 else n * (before + n)
    if scored:
        return _trained(shape, n, pairs, scored)
    full = shape.n_layers - 1  # the last layer: forward whole, backward only through wk/wv
    gemm = 3 * n * full * shape.layer + n * shape.layer + 2 * n * shape.kv
    return Flops(gemm, (3 * full + 1) * pairs * shape.pair)


def executed_tree_flops(
    system: str,
    shape,
    tree: RolloutTree,
    *,
    layout: str = "padded",
    microbatch: int | Sequence[int] | None = None,
) -> Flops:
    """Training FLOPs of ``tree`` as ``system`` (``"prefixflow"`` or ``"baseline"``) executes it;
    ``microbatch``: paths per Phase-B (baseline) microbatch, None (all) or the sizes a ``"auto"`` plan chose."""
    shape = _dense(shape)
    if layout not in ("padded", "packed"):
        raise ValueError(f"layout must be padded|packed, got {layout!r}")
    plan = TreePlan(tree)
    if system == "baseline":
        rows = [plan.full_row(i) for i in range(tree.n)]
        work = Flops(0, 0)
    elif system == "prefixflow":
        rows = [plan.leaf_rows[i] for i in range(tree.n) if i in plan.leaf_rows]
        work = Flops(0, 0)
        for j in plan.cached:
            work += _node_flops(shape, tree, plan, j)
    else:
        raise ValueError(f"unknown system {system!r}; expected 'prefixflow' or 'baseline'")
    for chunk in _chunks(len(rows), microbatch):
        work += _rows_flops(shape, tree, [rows[i] for i in chunk], layout)
    return work


def ideal_tree_flops(shape, tree: RolloutTree) -> Flops:
    """The least work that trains every path of ``tree`` (see the module doc)."""
    shape = _dense(shape)
    plan = TreePlan(tree)
    leaf_cols: dict[int, set[int]] = {}
    for i, row in plan.leaf_rows.items():  # duplicate paths share their leaf: its positions count once
        leaf_cols.setdefault(tree.path_ends[i], set()).update(row.cols)
    work = Flops(0, 0)
    for j in range(len(tree.segments)):
        n, before = tree.node_len(j), tree.first_position[j]
        scored = len(plan.scores[j][0]) if j in plan.scores else len(leaf_cols.get(j, ()))
        work += _trained(shape, n, n * before + _causal(n), scored)
    return work
