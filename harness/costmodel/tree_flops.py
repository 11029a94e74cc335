"""FLOPs of one prefix tree (``prefixflow.RolloutTree``) as each system executes it, and the tree's ideal.

The counting rules are :mod:`harness.costmodel.flops`' (GEMMs 3x forward, attention pairs as each SDPA call
computes them: ``L(L+1)/2`` causal, every ``Lq·Lk`` pair under a mask). What runs
(``prefixflow.schedule.phases``, rows from ``prefixflow.tree.plan.TreeRows``):

* ``prefixflow``, Phase A/C per cached node (a node with children): one row of its ``n`` tokens after its
  ancestors' ``U`` cached keys (``U`` = the node's first position), every layer forward; causal when ``U = 0``;
  otherwise ``split``: ``n·U`` pairs over the cached keys and a causal own part, ``concat``: ``n·(U + n)``
  masked pairs; the LM head at the ``s`` trained tokens the node scores. With ``s > 0`` its backward runs
  everything back; with ``s = 0`` its forward stops after the last layer's K/V and its backward never reaches
  the last layer's attention, ``wq``, ``wo`` or MLP (only its ``wk``/``wv``).
* ``prefixflow``, Phase B: the paths' leaf rows (a leaf's tokens but its last) in microbatches (paths with no
  leaf token to score run none), over the union ``K`` of the microbatch's ancestor keys: ``split``: ``rows·K``
  pairs and the own part causal (padded, or a packed row of one path) or block-diagonal (``R²`` packed);
  ``concat``: ``b·W·(K + W)`` padded, ``R·(K + R)`` packed (``R`` = its tokens).
* ``baseline``: every path but its last token as a full sequence, in microbatches of paths (causal padded,
  block-diagonal mask packed), as :func:`~harness.costmodel.flops.executed_flops` does for a flat group.

:func:`ideal_tree_flops` is the least work any schedule that trains every path must do: each of the trie's
unique tokens once through every layer forward and backward, causal pairs along each node's path only, the
LM head at each distinct scored position once (a leaf's last token predicts nothing: it never runs). ``baseline / ideal`` is the unique-token ideal speedup.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixflow.tree.layouts import Row
from prefixflow.tree.plan import TreeRows
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


def _pairs(k: int, lens: list[int], firsts: list[int], layout: str, attention: str) -> int:
    """Attention pairs per layer of one microbatch of rows of ``lens`` tokens after ``k`` cached keys, as
    ``prefixflow.tree.layouts.lay_out`` and ``NodeAttention`` run them. ``split`` (with cached keys): one call
    over the cached keys, ``rows x k`` pairs, and the own part causal when padded or a packed row of one
    sequence, else every pair of its masked call. ``concat``: one masked call over ``[cached ; own]``. With no
    cached key a padded batch of rows at position 0 runs the plain causal forward."""
    if layout == "packed":
        slots = sum(lens)
        if attention == "split" and k:
            return slots * k + (_causal(slots) if len(lens) == 1 else slots * slots)
        return slots * (k + slots)
    b, w = len(lens), max(lens)
    if k == 0 and all(f == 0 for f in firsts):
        return b * _causal(w)
    if attention == "split" and k:
        return b * w * k + b * _causal(w)
    return b * w * (k + w)


def _rows_flops(shape, tree: RolloutTree, rows: list[Row], layout: str, attention: str) -> Flops:
    """One microbatch of ``rows`` as ``prefixflow.tree.layouts.lay_out`` lays it out."""
    keys = {j for r in rows for j in r.ancestors}
    k = sum(tree.node_len(j) for j in keys)
    lens = [len(r) for r in rows]
    scored = sum(len(r.cols) for r in rows)
    slots = sum(lens) if layout == "packed" else len(lens) * max(lens)
    pairs = _pairs(k, lens, [r.first_position for r in rows], layout, attention)
    return _trained(shape, slots, pairs, scored)


def _node_flops(shape, tree: RolloutTree, rows: TreeRows, j: int, attention: str) -> Flops:
    """A cached node's Phase A and Phase C. A node that scores nothing stops after its last layer's K/V, and
    its backward never reaches the last layer's attention, wq, wo or MLP (the flat prefix's rule)."""
    n, before = tree.node_len(j), tree.first_position[j]
    scored = rows.scores(j)
    pairs = _pairs(before, [n], [before], "padded", attention)
    if scored:
        return _trained(shape, n, pairs, scored)
    full = shape.n_layers - 1
    gemm = 3 * n * full * shape.layer + n * (shape.qkv + 2 * shape.kv)
    return Flops(gemm, 3 * full * pairs * shape.pair)


def executed_tree_flops(
    system: str,
    shape,
    tree: RolloutTree,
    *,
    layout: str = "padded",
    microbatch: int | Sequence[int] | None = None,
    attention: str = "split",
) -> Flops:
    """Training FLOPs of ``tree`` as ``system`` (``"prefixflow"`` or ``"baseline"``) executes it;
    ``microbatch``: paths per Phase-B (baseline) microbatch, None (all) or the sizes a ``"auto"`` plan chose;
    ``attention``: PrefixFlow's attention variant (``PrefixFlowConfig.attention``, resolved)."""
    shape = _dense(shape)
    if layout not in ("padded", "packed") or attention not in ("split", "concat"):
        raise ValueError(
            f"layout must be padded|packed and attention split|concat, got {layout}, {attention}"
        )
    rows = TreeRows(tree)
    if system == "baseline":
        run = [rows.full_row(i) for i in range(tree.n)]
        work = Flops(0, 0)
    elif system == "prefixflow":
        run = [rows.leaf_rows[i] for i in rows.dfs_paths if i in rows.leaf_rows]
        work = Flops(0, 0)
        for j in rows.cached:
            work += _node_flops(shape, tree, rows, j, attention)
    else:
        raise ValueError(f"unknown system {system!r}; expected 'prefixflow' or 'baseline'")
    for chunk in _chunks(len(run), microbatch):
        work += _rows_flops(shape, tree, [run[i] for i in chunk], layout, attention)
    return work


def ideal_tree_flops(shape, tree: RolloutTree) -> Flops:
    """The least work that trains every path of ``tree`` (see the module doc)."""
    shape = _dense(shape)
    rows = TreeRows(tree)
    leaf_cols: dict[int, set[int]] = {}
    for i, row in rows.leaf_rows.items():  # duplicate paths share their leaf: its positions count once
        leaf_cols.setdefault(tree.path_ends[i], set()).update(row.cols.tolist())
    work = Flops(0, 0)
    for j in range(len(tree.segments)):
        n, before = tree.node_len(j), tree.first_position[j]
        if j not in rows.node_rows:
            n -= 1  # a leaf's last token predicts nothing and nothing reads its K/V
        scored = rows.scores(j) if j in rows.node_rows else len(leaf_cols.get(j, ()))
        if n:
            work += _trained(shape, n, n * before + _causal(n), scored)
    return work
