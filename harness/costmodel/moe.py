"""The cost model's MoE terms: what one token costs in an MoE layer (active parameters, not total).

A token runs the attention projections as in a dense layer; its FFN is the router (``dim x E`` logits over
all experts), its ``top_k`` routed experts and the shared experts, each a SwiGLU of width ``moe_inter_dim``.
Forward GEMM FLOPs per token and MoE layer::

    2·dim·E  +  6·dim·moe_inter_dim·(top_k + num_shared_experts)

and, as for every GEMM, backward costs twice the forward. :class:`MoEShape` is a
:class:`~harness.costmodel.flops.ModelShape` whose ``hidden_dim`` is the *active* FFN width
``moe_inter_dim·(top_k + num_shared_experts)`` and whose per-token layer cost adds the router, so every
formula of :mod:`harness.costmodel.flops` (baseline, PrefixFlow, the ideal speedup) applies to MoE unchanged.
Dropless routing is assumed (no token is dropped or padded to a capacity), as under routing replay.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.costmodel.shape import ModelShape

__all__ = ["MoEShape", "moe_shape", "active_params_per_token", "total_params"]


@dataclass(frozen=True)
class MoEShape(ModelShape):
    """A dense shape plus the MoE FFN: ``num_experts`` routed experts (``top_k`` per token) and
    ``num_shared_experts`` always-on experts, each of width ``moe_inter_dim``; every layer is MoE."""

    num_experts: int = 0
    top_k: int = 0
    moe_inter_dim: int = 0
    num_shared_experts: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.top_k <= self.num_experts or self.moe_inter_dim <= 0 or self.num_shared_experts < 0:
            raise ValueError(
                f"MoEShape needs 0 < top_k <= num_experts, moe_inter_dim > 0 and num_shared_experts >= 0; got "
                f"top_k={self.top_k}, num_experts={self.num_experts}, moe_inter_dim={self.moe_inter_dim}, "
                f"num_shared_experts={self.num_shared_experts}"
            )
        active = self.moe_inter_dim * (self.top_k + self.num_shared_experts)
        if self.hidden_dim != active:
            raise ValueError(
                f"MoEShape.hidden_dim must be the active FFN width {active}, got {self.hidden_dim}"
            )

    @property
    def router(self) -> int:
        """Forward FLOPs of one token's router logits in one layer."""
        return 2 * self.dim * self.num_experts

    @property
    def attention_projections(self) -> int:
        """Forward FLOPs of one token's q, k, v and o projections in one layer."""
        hd = self.head_dim
        return 2 * self.dim * (self.n_heads + 2 * self.n_kv_heads) * hd + 2 * self.n_heads * hd * self.dim

    @property
    def layer(self) -> int:
        """Forward GEMM FLOPs of one token through one MoE layer (its active experts only)."""
        return self.attention_projections + 6 * self.dim * self.hidden_dim + self.router

    @property
    def linear_macs_per_token(self) -> int:
        """Per-token MACs of all layers' projections, routers and active experts (no attention, no head)."""
        return self.n_layers * self.layer // 2


def moe_shape(args) -> MoEShape:
    """The :class:`MoEShape` of a TorchTitan Qwen3 ``ModelArgs`` with ``moe_enabled``."""
    moe = args.moe_args
    n_kv = int(args.n_kv_heads or args.n_heads)
    return MoEShape(
        dim=int(args.dim),
        n_layers=int(args.n_layers),
        n_heads=int(args.n_heads),
        n_kv_heads=n_kv,
        head_dim=int(args.head_dim),
        hidden_dim=int(args.moe_inter_dim) * (int(moe.top_k) + int(moe.num_shared_experts)),
        vocab_size=int(args.vocab_size),
        num_experts=int(moe.num_experts),
        top_k=int(moe.top_k),
        moe_inter_dim=int(args.moe_inter_dim),
        num_shared_experts=int(moe.num_shared_experts),
    )


def _attention_params(shape: ModelShape) -> int:
    hd = shape.head_dim
    return shape.dim * (shape.n_heads + 2 * shape.n_kv_heads) * hd + shape.n_heads * hd * shape.dim


def active_params_per_token(shape: MoEShape, *, embeddings: bool = True) -> int:
    """Parameters one token's forward multiplies with: attention, router, its top-k and the shared experts
    in every layer, plus the embedding row and the LM head (``embeddings``; norms are not counted)."""
    per_layer = _attention_params(shape) + shape.dim * shape.num_experts + 3 * shape.dim * shape.hidden_dim
    return shape.n_layers * per_layer + (2 * shape.dim * shape.vocab_size if embeddings else 0)


def total_params(shape: MoEShape, *, embeddings: bool = True, tied: bool = False) -> int:
    """All parameters but the norms: every routed expert counts."""
    experts = 3 * shape.dim * shape.moe_inter_dim * (shape.num_experts + shape.num_shared_experts)
    per_layer = _attention_params(shape) + shape.dim * shape.num_experts + experts
    vocab = shape.dim * shape.vocab_size * (1 if tied else 2) if embeddings else 0
    return shape.n_layers * per_layer + vocab
