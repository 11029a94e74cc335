"""The dimensions that set a dense decoder's FLOPs (:class:`ModelShape`); ``harness.costmodel.moe`` extends
them with the MoE FFN."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelShape"]


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that set a dense decoder's FLOPs."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    vocab_size: int

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "vocab_size"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"ModelShape.{name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

    @property
    def qkv(self) -> int:
        """Forward FLOPs of one token's q, k and v projections in one layer."""
        return 2 * self.dim * (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    @property
    def kv(self) -> int:
        return 4 * self.dim * self.n_kv_heads * self.head_dim

    @property
    def layer(self) -> int:
        """Forward GEMM FLOPs of one token through one layer."""
        return self.qkv + 2 * self.n_heads * self.head_dim * self.dim + 6 * self.dim * self.hidden_dim

    @property
    def head(self) -> int:
        """LM-head forward FLOPs per scored position."""
        return 2 * self.dim * self.vocab_size

    @property
    def pair(self) -> int:
        """Attention forward FLOPs per (query, key) pair in one layer (``QKᵀ`` and ``PV``, all query heads)."""
        return 4 * self.n_heads * self.head_dim
