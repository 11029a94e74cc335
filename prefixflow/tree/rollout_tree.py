"""A prefix tree of rollouts (:class:`RolloutTree`): token segments on nodes, one trained path per sequence.

Path ``i`` is the concatenation of the segments from a root down to node ``path_ends[i]``; its loss mask,
advantage and optional old/ref log-probs are per path, over the path's whole length. The objective is per
path: a token in a node shared by k paths is counted once for each of them, with that path's own weight.
Built from flat sequences by :func:`prefixflow.build_tree`; a flat group is the depth-1 case
(``RolloutGroup.as_tree``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

__all__ = ["RolloutTree", "PathLosses", "check_inputs"]


def _real_tensor(field: str, value, n: int) -> torch.Tensor:
    """``value`` (N numbers or a tensor) as a finite real 1-D tensor of ``n`` entries (fp64 when integer)."""
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"{field} must be a real tensor of {n} numbers: {e}") from None
    if value.device.type == "meta":
        raise ValueError(
            f"{field} is on the meta device (a shape without values); pass a materialised tensor"
        )
    if value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"{field} must be real numbers, got dtype {value.dtype}")
    if not value.dtype.is_floating_point:
        value = value.double()
    if value.shape != (n,):
        raise ValueError(f"{field} must have shape ({n},) (one per path), got {tuple(value.shape)}")
    if not torch.isfinite(value).all():
        raise ValueError(f"{field} must be finite (found NaN or inf)")
    return value


def check_tokens(field: str, t) -> torch.Tensor:
    """A non-empty 1-D tensor of token ids >= 0, as a LongTensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{field} must be a torch.LongTensor of token ids, got {type(t).__name__}")
    if t.device.type == "meta":
        raise ValueError(
            f"{field} is on the meta device (a shape without values); pass a materialised tensor"
        )
    if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        raise TypeError(f"{field} must hold integer token ids, got dtype {t.dtype}; use tokens.long()")
    if t.dim() != 1:
        raise ValueError(f"{field} must be 1-D (a token sequence), got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{field} is empty; every sequence and node needs at least one token")
    if int(t.min()) < 0:
        raise ValueError(f"{field} has negative token ids (min {int(t.min())}); token ids must be >= 0")
    return t.long()


def check_loss_mask(field: str, mask, length: int, first_trainable: bool = False) -> torch.Tensor:
    """A bool mask of ``length`` entries with at least one True; ``first_trainable=False``: not on index 0."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"{field} must be a bool tensor (True where the token is trained)")
    if mask.shape != (length,):
        raise ValueError(f"{field} has shape {tuple(mask.shape)}; its sequence has {length} tokens")
    if not first_trainable and bool(mask[0]):
        raise ValueError(f"{field} marks the sequence's first token, which no position predicts")
    if not bool(mask.any()):
        raise ValueError(f"{field} marks no token; every path needs at least one trained token")
    return mask


def check_logprobs(field: str, value, lengths: list[int]) -> list[torch.Tensor] | None:
    """None, or a list of one finite float tensor per sequence of the given lengths."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != len(lengths):
        raise ValueError(f"{field} must be a list of {len(lengths)} tensors, one per path")
    for i, (lp, n) in enumerate(zip(value, lengths, strict=True)):
        if not isinstance(lp, torch.Tensor) or not lp.dtype.is_floating_point:
            raise TypeError(f"{field}[{i}] must be a real floating tensor of per-token log-probs")
        if lp.shape != (n,):
            raise ValueError(f"{field}[{i}] has shape {tuple(lp.shape)}; its path has {n} tokens")
        if not torch.isfinite(lp).all():
            raise ValueError(f"{field}[{i}] must be finite (found NaN or inf)")
    return list(value)


def _indices(field: str, value, none: int | None = None) -> list[int]:
    """A list / tuple / 1-D integer tensor or array of node indices as Python ints (``None`` -> ``none``)."""
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        dtype = getattr(value, "dtype", None)
        if getattr(value, "ndim", 1) != 1 or str(dtype).rsplit(".", 1)[-1].startswith(
            ("float", "complex", "bool")
        ):
            raise ValueError(f"{field} must be a list (or 1-D integer tensor) of node indices, got {value!r}")
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{field} must be a list of node indices, got {type(value).__name__}")
    out = []
    for j, x in enumerate(value):
        if x is None and none is not None:
            out.append(none)
            continue
        try:
            if isinstance(x, bool) or getattr(x, "dtype", None) is not None and "bool" in str(x.dtype):
                raise TypeError
            out.append(operator.index(x))
        except TypeError:
            raise ValueError(f"{field}[{j}] = {x!r} is not a node index (an int)") from None
    return out


def check_inputs(field: str, inputs) -> dict[str, torch.Tensor] | None:
    """None, or a dict of multimodal forward inputs: str keys, materialised tensors (the adapter checks more)."""
    if inputs is None:
        return None
    if not isinstance(inputs, dict):
        raise TypeError(f"{field} must be a dict of the processor's extra outputs (name -> tensor)")
    out = {}
    for key, value in inputs.items():
        if not isinstance(key, str):
            raise TypeError(f"{field} keys must be the model's keyword names (str), got {key!r}")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{field}[{key!r}] must be a torch.Tensor, got {type(value).__name__}")
        if value.device.type == "meta":
            raise ValueError(f"{field}[{key!r}] is on the meta device; pass a materialised tensor")
        out[key] = value
    return out or None


@dataclass
class PathLosses:
    """What the loss reads of a tree, per path, in the shape it reads a group: ``response_lens`` = each
    path's trained-token count, ``old_logprobs``/``ref_logprobs`` = their values at the trained tokens."""

    advantages: torch.Tensor
    response_lens: list[int]
    old_logprobs: list[torch.Tensor] | None
    ref_logprobs: list[torch.Tensor] | None

    @property
    def n(self) -> int:
        return len(self.response_lens)


@dataclass
class RolloutTree:
    """Rollouts as a prefix tree (a forest when several nodes have no parent).

    ``segments``: one non-empty 1-D LongTensor per node; ``parents``: the parent node of each node, or -1 /
    None for a root; ``path_ends``: the node each path ends at (any node, internal ones included; several
    paths may end at one node). ``advantages``: Tensor[N]; ``loss_masks``: N bool tensors over each path's
    tokens (True = trained; never the root's first token); ``old_logprobs``/``ref_logprobs``: optional N float
    tensors over each path's tokens (read at trained tokens only). ``routing``: optional recorded MoE routing,
    one LongTensor[n_moe_layers, node_len, k] of expert ids per node (``prefixflow.record_routing(model,
    tree)``), which both systems replay. ``path_inputs``: optional, per path, the extra forward keywords a
    multimodal model's processor returns for the path's leading tokens (batch of one; token-aligned entries
    such as ``mm_token_type_ids`` may cover fewer tokens than the path: the rest is text); the model's
    adapter reads them (docs/multimodal.md). Validated on construction.
    """

    segments: list[torch.Tensor]
    parents: list[int | None]
    path_ends: list[int]
    advantages: torch.Tensor
    loss_masks: list[torch.Tensor]
    old_logprobs: list[torch.Tensor] | None = None
    ref_logprobs: list[torch.Tensor] | None = None
    routing: list[torch.Tensor] | None = None
    path_inputs: list[dict[str, torch.Tensor] | None] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.segments, (list, tuple)) or not self.segments:
            raise ValueError("segments must be a non-empty list of 1-D LongTensors, one per node")
        names = [f"segments[{j}]" for j in range(len(self.segments))]
        self.segments = [check_tokens(f, s) for f, s in zip(names, self.segments, strict=True)]
        n_nodes = len(self.segments)
        self.parents = _indices("parents", self.parents, none=-1)
        if len(self.parents) != n_nodes:
            raise ValueError(
                f"parents has {len(self.parents)} entries; the tree has {n_nodes} nodes (a node index, or -1 "
                "for a root, each)"
            )
        for j, p in enumerate(self.parents):
            if not -1 <= p < n_nodes:
                raise ValueError(f"parents[{j}] = {p} is a dangling parent: no node {p} in the tree")
        parents = self.parents
        self._order_nodes()
        self.path_ends = _indices("path_ends", self.path_ends)
        if not self.path_ends:
            raise ValueError("path_ends must be a non-empty list: the node each path ends at")
        for i, e in enumerate(self.path_ends):
            if not 0 <= e < n_nodes:
                raise ValueError(f"path_ends[{i}] = {e} is not a node of the tree")
        unended = sorted(set(range(n_nodes)) - set(self.path_ends) - {p for p in parents if p >= 0})
        if unended:
            raise ValueError(f"node {unended[0]} is a leaf that no path ends at (path_ends)")
        n = self.n
        self.advantages = _real_tensor("advantages", self.advantages, n)
        if not isinstance(self.loss_masks, (list, tuple)) or len(self.loss_masks) != n:
            raise ValueError(f"loss_masks must be a list of {n} bool tensors, one per path")
        lengths = self.path_lens
        self.loss_masks = [
            check_loss_mask(f"loss_masks[{i}]", m, lengths[i]) for i, m in enumerate(self.loss_masks)
        ]
        self.old_logprobs = check_logprobs("old_logprobs", self.old_logprobs, lengths)
        self.ref_logprobs = check_logprobs("ref_logprobs", self.ref_logprobs, lengths)
        self.routing = self.checked_routing()
        if self.path_inputs is not None:
            if not isinstance(self.path_inputs, (list, tuple)) or len(self.path_inputs) != n:
                raise ValueError(f"path_inputs must be a list of {n} dicts (or None), one per path")
            self.path_inputs = [check_inputs(f"path_inputs[{i}]", x) for i, x in enumerate(self.path_inputs)]
            if all(x is None for x in self.path_inputs):
                self.path_inputs = None

    def checked_routing(self) -> list[torch.Tensor] | None:
        """``routing`` validated against the nodes (one ``[layers, node_len, k]`` LongTensor of expert ids
        >= 0 each, every node alike in layers and k); raises ValueError naming the entry."""
        if self.routing is None:
            return None
        if not isinstance(self.routing, (list, tuple)) or len(self.routing) != self.n_nodes:
            raise ValueError(f"routing must be a list of {self.n_nodes} masks, one per node")
        out = []
        for j, m in enumerate(self.routing):
            if not isinstance(m, torch.Tensor) or m.dtype.is_floating_point or m.dtype == torch.bool:
                raise ValueError(f"routing[{j}] must be an integer tensor of expert ids")
            first = out[0] if out else m
            if (
                m.dim() != 3
                or m.shape[1] != self.node_len(j)
                or (m.shape[0], m.shape[2])
                != (
                    first.shape[0],
                    first.shape[2],
                )
            ):
                raise ValueError(
                    f"routing[{j}] has shape {tuple(m.shape)}; expected [layers, {self.node_len(j)}, k] "
                    "(node length; the same layers and k on every node)"
                )
            if m.numel() and int(m.min()) < 0:
                raise ValueError(f"routing[{j}] has a negative expert id")
            out.append(m.long())
        return out

    def _order_nodes(self) -> None:
        """Children, depths and a top-down (preorder) node order; a cycle raises."""
        n_nodes = len(self.segments)
        self.children: list[list[int]] = [[] for _ in range(n_nodes)]
        for j, p in enumerate(self.parents):
            if p >= 0:
                self.children[p].append(j)
        self.order: list[int] = []
        self.first_position = [0] * n_nodes
        stack = [j for j in reversed(range(n_nodes)) if self.parents[j] < 0]
        while stack:
            j = stack.pop()
            self.order.append(j)
            for c in reversed(self.children[j]):
                self.first_position[c] = self.first_position[j] + self.node_len(j)
                stack.append(c)
        if len(self.order) != n_nodes:
            cyclic = min(set(range(n_nodes)) - set(self.order))
            raise ValueError(f"parents form a cycle through node {cyclic}; a tree's parents lead to a root")

    @property
    def n(self) -> int:
        """The number of paths (trained sequences)."""
        return len(self.path_ends)

    @property
    def n_nodes(self) -> int:
        return len(self.segments)

    def node_len(self, j: int) -> int:
        return int(self.segments[j].numel())

    def ancestors(self, j: int) -> list[int]:
        """The nodes above ``j``, root first."""
        chain = []
        while self.parents[j] >= 0:
            j = self.parents[j]
            chain.append(j)
        return chain[::-1]

    def path_nodes(self, i: int) -> list[int]:
        """The nodes of path ``i``, root first."""
        end = self.path_ends[i]
        return [*self.ancestors(end), end]

    @property
    def path_lens(self) -> list[int]:
        return [self.first_position[e] + self.node_len(e) for e in self.path_ends]

    def path_tokens(self, i: int) -> torch.Tensor:
        return torch.cat([self.segments[j] for j in self.path_nodes(i)])

    @property
    def unique_tokens(self) -> int:
        """Tokens of the tree, each node's once."""
        return sum(self.node_len(j) for j in range(self.n_nodes))

    def path_losses(self) -> PathLosses:
        """The per-path view the loss functions read (:class:`PathLosses`)."""

        def at_masks(values):
            if values is None:
                return None
            return [v[m] for v, m in zip(values, self.loss_masks, strict=True)]

        counts = [int(m.sum()) for m in self.loss_masks]
        return PathLosses(self.advantages, counts, at_masks(self.old_logprobs), at_masks(self.ref_logprobs))

    def check_fits(self, vocab_size: int, max_seq_len: int, field: str = "max_seq_len") -> None:
        """Raise ValueError if a token id is outside the vocabulary or a path exceeds ``max_seq_len`` (the
        model's config ``field``)."""
        for j, s in enumerate(self.segments):
            if int(s.max()) >= vocab_size:
                raise ValueError(
                    f"segments[{j}] has token id {int(s.max())} outside the model's vocabulary [0, {vocab_size})"
                )
        lengths = self.path_lens
        longest = max(range(self.n), key=lambda i: lengths[i])
        if lengths[longest] > max_seq_len:
            raise ValueError(
                f"path {longest} has {lengths[longest]} tokens, more than the model's {field}={max_seq_len}"
            )

    def check_representable(self, dtype: torch.dtype) -> None:
        """Raise ValueError naming the field if a value overflows ``dtype``, the loss's compute dtype."""
        fields = [("advantages", self.advantages)]
        for name in ("old_logprobs", "ref_logprobs"):
            fields += [(f"{name}[{i}]", t) for i, t in enumerate(getattr(self, name) or [])]
        for field, t in fields:
            if not torch.isfinite(t.to(dtype)).all():
                raise ValueError(f"{field} holds a value that overflows {dtype}, the loss's compute dtype")

    def to(self, device) -> RolloutTree:
        def move(xs):
            return None if xs is None else [x.to(device) for x in xs]

        return RolloutTree(
            move(self.segments), list(self.parents), list(self.path_ends), self.advantages.to(device),
            move(self.loss_masks), move(self.old_logprobs), move(self.ref_logprobs), move(self.routing),
            None if self.path_inputs is None else _move_inputs(self.path_inputs, device),
        )  # fmt: skip


def _move_inputs(path_inputs: list, device) -> list:
    """Each path's inputs on ``device``; paths that share one dict keep sharing one (a group's prompt)."""
    moved: dict[int, dict] = {}
    for x in path_inputs:
        if x is not None and id(x) not in moved:
            moved[id(x)] = {k: v.to(device) for k, v in x.items()}
    return [None if x is None else moved[id(x)] for x in path_inputs]
