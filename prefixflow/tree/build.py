"""``build_tree``: a :class:`~prefixflow.tree.RolloutTree` from flat token sequences, as a compressed trie.

What TRL and verl batches hold once their padding is stripped is N token sequences; the trie shares every
common prefix, whether the branch point falls between turns or inside one.
"""

from __future__ import annotations

import numpy as np
import torch

from .media import content_keys
from .rollout_tree import RolloutTree, check_inputs, check_logprobs, check_loss_mask, check_tokens

__all__ = ["AUTO_NODE_COST_TOKENS", "build_tree"]

#: ``min_shared_tokens="auto"``: a shared node's fixed cost (one more Phase-A forward and Phase-C backward, its
#: cache and masks), in tokens of per-token work. Splitting out a node of ``l`` tokens with ``h`` heirs (its
#: children, plus one for the paths ending at it) saves ``(h - 1) * l`` tokens of recomputation; it pays when
#: that is at least this. Measured on CPU (Llama3, dim 128, 2 layers, fp32, one thread: the crossover of
#: split vs merged nodes, 43 tokens; 50 at dim 64, 34 at dim 256) by ``python -m harness.peers.node_cost``
#: (docs/trees-practice.md, "min_shared_tokens='auto'").
AUTO_NODE_COST_TOKENS = 43


class _Node:
    __slots__ = ("tokens", "parent", "children", "ends", "kids")

    def __init__(self, tokens: np.ndarray, parent: _Node | None) -> None:
        self.tokens, self.parent = tokens, parent
        self.children: list[_Node] = []
        self.ends: list[int] = []  # the sequences that end at this node
        self.kids: dict[int, _Node] = {}  # first token -> child (while the trie is built)


def build_tree(
    sequences: list[torch.Tensor],
    advantages,
    loss_masks: list[torch.Tensor] | None = None,
    *,
    old_logprobs: list[torch.Tensor] | None = None,
    ref_logprobs: list[torch.Tensor] | None = None,
    min_shared_tokens: int | str = 1,
    path_inputs: list[dict[str, torch.Tensor] | None] | None = None,
) -> RolloutTree:
    """The prefix tree of ``sequences`` (N unpadded 1-D token tensors); path ``i`` is ``sequences[i]``.

    ``advantages``: N floats or a 1-D tensor. ``loss_masks``: N bool tensors of the sequences' lengths, True
    where the token is trained; None trains every token after the sequences' longest common prefix.
    ``old_logprobs``/``ref_logprobs``: N float tensors of the same lengths. A shared node shorter than
    ``min_shared_tokens`` is not split out: its tokens go to each of its children. ``"auto"`` (opt-in): a node
    is split out when the work it saves pays its fixed cost, ``(heirs - 1) * tokens >=``
    :data:`AUTO_NODE_COST_TOKENS` (heirs: its children, plus one for paths ending at it). Duplicate sequences and a
    sequence that is a prefix of another are paths ending at a shared or internal node; sequences that share
    no first token make a forest.

    ``path_inputs``: per sequence, the multimodal forward inputs its processor returned for it (batch of one;
    :class:`RolloutTree`'s ``path_inputs``). Different images share placeholder ids, so paths share a node
    only where their token ids and their images, compared by content, agree
    (:func:`~prefixflow.tree.media.content_keys`).
    """
    if isinstance(sequences, torch.Tensor) or not isinstance(sequences, (list, tuple)) or not sequences:
        raise TypeError("sequences must be a non-empty list of 1-D LongTensors (unpadded token ids)")
    auto = min_shared_tokens == "auto"
    if not auto and (
        isinstance(min_shared_tokens, bool) or not isinstance(min_shared_tokens, int) or min_shared_tokens < 1
    ):
        raise ValueError(f"min_shared_tokens must be an int >= 1 or 'auto', got {min_shared_tokens!r}")
    seqs = [check_tokens(f"sequences[{i}]", s) for i, s in enumerate(sequences)]
    lengths = [int(s.numel()) for s in seqs]
    if loss_masks is None:
        loss_masks = _after_common_prefix(seqs)
    elif not isinstance(loss_masks, (list, tuple)) or len(loss_masks) != len(seqs):
        raise ValueError(f"loss_masks must be None or a list of {len(seqs)} bool tensors, one per sequence")
    masks = [
        check_loss_mask(f"loss_masks[{i}]", m, n)
        for i, (m, n) in enumerate(zip(loss_masks, lengths, strict=True))
    ]
    old_logprobs = check_logprobs("old_logprobs", old_logprobs, lengths)
    ref_logprobs = check_logprobs("ref_logprobs", ref_logprobs, lengths)
    if path_inputs is not None:
        if not isinstance(path_inputs, (list, tuple)) or len(path_inputs) != len(seqs):
            raise ValueError(
                f"path_inputs must be None or a list of {len(seqs)} dicts (or None), one per sequence"
            )
        path_inputs = [check_inputs(f"path_inputs[{i}]", x) for i, x in enumerate(path_inputs)]
    codes, decode = _encoded(seqs, content_keys(seqs, path_inputs))
    roots = _merge_short(_compressed_trie(codes), None if auto else min_shared_tokens)
    segments, parents, path_ends = [], [], [0] * len(seqs)
    stack = [(r, -1) for r in reversed(roots)]
    while stack:  # number the nodes top-down (preorder)
        node, parent = stack.pop()
        j = len(segments)
        segments.append(torch.from_numpy(decode(node.tokens)))
        parents.append(parent)
        for i in node.ends:
            path_ends[i] = j
        stack.extend((c, j) for c in reversed(node.children))
    return RolloutTree(
        segments, parents, path_ends, advantages, masks, old_logprobs, ref_logprobs, path_inputs=path_inputs
    )


def _after_common_prefix(seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``loss_masks=None``: every token after the sequences' longest common prefix (never the first)."""
    first = seqs[0]
    common = min(int(s.numel()) for s in seqs)
    for s in seqs[1:]:
        differ = torch.nonzero(s[:common] != first[:common])
        common = int(differ[0, 0]) if differ.numel() else common
    for i, s in enumerate(seqs):
        if int(s.numel()) <= common:
            raise ValueError(
                f"loss_masks=None trains the tokens after the sequences' longest common prefix ({common} "
                f"tokens), but sequences[{i}] has none after it; pass loss_masks"
            )
    return [torch.arange(int(s.numel())) >= max(common, 1) for s in seqs]


def _encoded(seqs: list[torch.Tensor], keys: list[list] | None):
    """The sequences as int64 arrays the trie compares, and the function that turns a node's codes back into
    token ids. Without content keys the codes are the token ids; a token with a key (a placeholder standing
    for an image) gets a negative code of its own per ``(token, key)``, so equal ids of different images
    differ."""
    arrays = [s.cpu().numpy().astype(np.int64, copy=True) for s in seqs]
    if keys is None:
        return arrays, lambda codes: np.array(codes, dtype=np.int64)  # a contiguous copy
    pairs: dict[tuple, int] = {}
    tokens: list[int] = []
    for arr, row in zip(arrays, keys, strict=True):
        for t in (t for t, key in enumerate(row) if key is not None):
            code = pairs.setdefault((int(arr[t]), row[t]), len(pairs))
            if code == len(tokens):
                tokens.append(int(arr[t]))
            arr[t] = -1 - code
    lookup = np.array(tokens, dtype=np.int64)

    def decode(codes: np.ndarray) -> np.ndarray:
        out = np.array(codes, dtype=np.int64)
        keyed = out < 0
        out[keyed] = lookup[-1 - out[keyed]]
        return out

    return arrays, decode


def _compressed_trie(seqs: list[np.ndarray]) -> list[_Node]:
    """The trie of ``seqs`` (int64 codes, :func:`_encoded`) with every unary run one node (a radix trie: each
    sequence is inserted run by run, a node split where a sequence branches off or ends inside it). Returns
    the roots."""
    top = _Node(np.empty(0, dtype=np.int64), None)
    for i, seq in enumerate(seqs):
        node, pos, n = top, 0, len(seq)
        while pos < n:
            child = node.kids.get(int(seq[pos]))
            if child is None:
                child = _Node(seq[pos:], node)
                node.children.append(child)
                node.kids[int(seq[pos])] = child
                node, pos = child, n
                break
            run = child.tokens
            m = min(len(run), n - pos)
            differ = np.flatnonzero(run[:m] != seq[pos : pos + m])
            k = int(differ[0]) if differ.size else m
            if k < len(run):  # the sequence branches off (or ends) inside the run: split it there
                upper = _Node(run[:k], node)
                node.children[node.children.index(child)] = upper
                node.kids[int(run[0])] = upper
                child.tokens, child.parent = run[k:], upper
                upper.children, upper.kids = [child], {int(run[k]): child}
                child = upper
            node, pos = child, pos + k
        node.ends.append(i)
    for node in top.children:
        node.parent = None
    return top.children


def _too_short(node: _Node, min_shared: int | None) -> bool:
    """Whether ``node`` (with children) is merged into its heirs: shorter than ``min_shared`` tokens, or with
    ``None`` ("auto") when the recomputation it saves is less than its fixed cost."""
    if min_shared is not None:
        return len(node.tokens) < min_shared
    heirs = len(node.children) + bool(node.ends)
    return (heirs - 1) * len(node.tokens) < AUTO_NODE_COST_TOKENS


def _merge_short(roots: list[_Node], min_shared: int | None) -> list[_Node]:
    """Top-down: a node with children that :func:`_too_short` rejects passes its tokens down to each child
    (and to a new leaf for the paths ending at it) and disappears."""
    kept: list[_Node] = []
    stack = list(reversed(roots))
    while stack:
        node = stack.pop()
        if node.children and _too_short(node, min_shared):
            heirs = list(node.children)
            if node.ends:
                leaf = _Node(node.tokens[:0], node.parent)
                leaf.ends = node.ends
                heirs.append(leaf)
            for heir in heirs:
                heir.tokens = np.concatenate([node.tokens, heir.tokens])
                heir.parent = node.parent
            if node.parent is not None:
                siblings = node.parent.children
                at = siblings.index(node)
                siblings[at : at + 1] = heirs
            stack.extend(reversed(heirs))  # a heir is checked again with its longer run
        else:
            if node.parent is None:
                kept.append(node)
            stack.extend(reversed(node.children))
    return kept
