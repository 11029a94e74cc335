"""Recorded routing of a rollout group (Rollout Routing Replay, R3): one prefix mask, per-response suffixes.

The rollout engine routes every token it feeds the model: the ``P`` prompt tokens once (the prefix mask,
stored beside the prefix KV cache and shared by the whole group) and, per response, every sampled token
but the last (the last one is never fed back). Training replays exactly these expert ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RoutingMasks", "check_routing_masks"]


@dataclass
class RoutingMasks:
    """Top-k expert ids per MoE layer (in ``model.layers`` order).

    ``prefix``: LongTensor[n_moe_layers, P, k], the prompt's tokens, shared by all responses.
    ``suffixes``: one LongTensor[n_moe_layers, S_i - 1, k] per response: its tokens fed to the model
    (every response token but the last).
    """

    prefix: torch.Tensor
    suffixes: list[torch.Tensor]

    @property
    def n_layers(self) -> int:
        return int(self.prefix.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.prefix.shape[2])

    def to(self, device) -> RoutingMasks:
        return RoutingMasks(self.prefix.to(device), [s.to(device) for s in self.suffixes])

    def check_model(self, n_layers: int, num_experts: int, top_k: int) -> None:
        """Raise ValueError naming the field when the masks do not fit the model's MoE layers."""
        if self.n_layers != n_layers:
            raise ValueError(
                f"routing.prefix has masks for {self.n_layers} MoE layers; the model has {n_layers}"
            )
        if self.top_k != top_k:
            raise ValueError(f"routing masks choose top-{self.top_k} experts; the model routes top-{top_k}")
        for name, t in [("routing.prefix", self.prefix)] + [
            (f"routing.suffixes[{i}]", s) for i, s in enumerate(self.suffixes)
        ]:
            if t.numel() and int(t.max()) >= num_experts:
                raise ValueError(
                    f"{name} has expert id {int(t.max())} outside the model's experts [0, {num_experts})"
                )


def _check_mask(name: str, t, rows: int, layers: int | None, k: int | None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a LongTensor of expert ids, got {type(t).__name__}")
    if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        raise TypeError(f"{name} must hold integer expert ids, got dtype {t.dtype}")
    if t.device.type == "meta":
        raise ValueError(f"{name} is on the meta device (a shape without values); pass a materialised tensor")
    if t.dim() != 3:
        raise ValueError(f"{name} must be 3-D [n_moe_layers, tokens, top_k], got shape {tuple(t.shape)}")
    want = (layers if layers is not None else t.shape[0], rows, k if k is not None else t.shape[2])
    if tuple(t.shape) != want:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {want} (n_moe_layers, tokens, top_k)")
    if t.shape[0] < 1 or t.shape[2] < 1:
        raise ValueError(f"{name} needs at least one MoE layer and top_k >= 1, got shape {tuple(t.shape)}")
    if t.numel() and int(t.min()) < 0:
        raise ValueError(f"{name} has a negative expert id ({int(t.min())}); expert ids must be >= 0")
    if t.shape[2] > 1 and t.numel():
        ordered = t.sort(dim=-1).values
        if (ordered[..., 1:] == ordered[..., :-1]).any():
            raise ValueError(f"{name} routes a token to the same expert twice; top-k ids must be distinct")
    return t.long()


def check_routing_masks(routing, prompt_len: int, response_lens: list[int]) -> RoutingMasks:
    """Validate ``routing`` against the group's lengths; returns it with LongTensor masks."""
    if not isinstance(routing, RoutingMasks):
        raise TypeError(f"routing must be a prefixflow.RoutingMasks, got {type(routing).__name__}")
    prefix = _check_mask("routing.prefix", routing.prefix, prompt_len, None, None)
    suffixes = routing.suffixes
    if not isinstance(suffixes, (list, tuple)) or len(suffixes) != len(response_lens):
        raise ValueError(f"routing.suffixes must be a list of {len(response_lens)} masks, one per response")
    layers, k = prefix.shape[0], prefix.shape[2]
    checked = [
        _check_mask(f"routing.suffixes[{i}]", s, n - 1, layers, k)
        for i, (s, n) in enumerate(zip(suffixes, response_lens, strict=True))
    ]
    return RoutingMasks(prefix, checked)
