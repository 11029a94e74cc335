"""The training-time state cache: what a recurrent layer keeps at the prefix boundary, and its gradients.

For an attention layer the boundary is the prefix K/V (:mod:`prefixflow.state.kv_cache`). For a linear-attention or
state-space layer (gated DeltaNet, Mamba-2) everything a suffix token reads from the prefix passes through the
layer's state at the prefix end: the recurrent state ``S_P`` and the causal convolution's tail (the last
``kernel - 1`` pre-convolution inputs). Prefix backward is linear in their adjoints, so the three phases carry
over with ``(S_P, tail)`` in place of ``(K_P, V_P)``:

- Phase A ``capture``s each stateful layer's live end state (graph attached) and makes detached leaves that
  require grad;
- Phase B reads the leaves (``read``: cast to the dtype the layer computed them in); every suffix microbatch's
  backward accumulates into ``leaf.grad``;
- Phase C joins ``roots()`` (live tensors and their accumulated gradients) to the K/V seeds of the one
  delayed prefix backward. ``release`` drops everything.

The cache does not know what the tensors mean: a layer's :class:`~prefixflow.state.layers.StateRule` names
them (e.g. ``("recurrent", "conv")``). The boundary is O(1) in the prefix length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["StateCache", "LayerState"]


@dataclass
class LayerState:
    live: dict[str, torch.Tensor]  # the prefix end state, attached to the prefix graph
    leaves: dict[str, torch.Tensor]  # detached copies the suffixes read; .grad accumulates the adjoints


class StateCache:
    """Per-layer prefix end states and their gradient accumulators for one rollout group.

    ``grad_dtype``: dtype of the leaves and therefore of the accumulated state gradients (fp32 when the model
    computes in bf16/fp16, as for gK/gV); suffixes read ``leaf.to(live dtype)``.
    """

    def __init__(self, grad_dtype: torch.dtype | None = None) -> None:
        self.grad_dtype = grad_dtype
        self.layers: dict[int, LayerState] = {}

    def __len__(self) -> int:
        return len(self.layers)

    def capture(self, layer: int, live: dict[str, torch.Tensor]) -> None:
        """Keep a layer's live end state and create the leaves the suffixes will read."""
        if layer in self.layers:
            raise RuntimeError(
                f"layer {layer} captured its state twice in one Phase A; release() the cache between groups"
            )
        leaves = {}
        for name, t in live.items():
            leaves[name] = t.detach().to(self.grad_dtype or t.dtype).requires_grad_(True)
        self.layers[layer] = LayerState(dict(live), leaves)

    def read(self, layer: int) -> dict[str, torch.Tensor] | None:
        """The leaves of ``layer`` in the dtype the layer computed them in (None: no prefix state, e.g. a
        one-token prompt; the layer then starts from its zero state)."""
        entry = self.layers.get(layer)
        if entry is None:
            return None
        return {name: leaf.to(entry.live[name].dtype) for name, leaf in entry.leaves.items()}

    def grads(self, layer: int) -> dict[str, torch.Tensor | None]:
        """The accumulated gradient of each state tensor of ``layer`` (None before any suffix backward)."""
        return {name: leaf.grad for name, leaf in self.layers[layer].leaves.items()}

    def roots(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Phase C's seeds: each live state tensor that received a gradient, and that gradient."""
        roots, grads = [], []
        for entry in self.layers.values():
            for name, live in entry.live.items():
                leaf = entry.leaves[name]
                if leaf.grad is None or not live.requires_grad:
                    continue
                roots.append(live)
                grads.append(leaf.grad.to(live.dtype))
        return roots, grads

    def nbytes(self) -> int:
        """Bytes held by the leaves and their accumulators (the live states are the prefix graph's)."""
        total = 0
        for entry in self.layers.values():
            for leaf in entry.leaves.values():
                for t in (leaf, leaf.grad):
                    if t is not None:
                        total += t.numel() * t.element_size()
        return total

    def release(self) -> None:
        """Drop live states (and with them their part of the prefix graph), leaves and accumulators."""
        for entry in self.layers.values():
            for leaf in entry.leaves.values():
                leaf.grad = None
        self.layers.clear()
