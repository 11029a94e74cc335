"""FLOPs of one rollout group per system, and the ideal PrefixFlow speedup (paper §3.1).

Counting (dense decoder, GEMM work only; norms, RoPE, softmax and the loss are ignored):

* per token and layer: q/o projections ``2·dim·H·hd``, k/v projections ``2·dim·Hkv·hd`` (GQA),
  SwiGLU MLP ``3·dim·hidden`` multiply-accumulates (MACs);
* attention: ``2·H·hd`` MACs per (query, key) pair per layer (QKᵀ and AV), causal pairs only;
* LM head ``dim·vocab`` MACs only at the ``S`` positions whose log-probs the loss needs;
* forward FLOPs = 2·MACs, backward = 2·forward, so one trained token costs 3·forward.

Lengths: ``P`` prompt tokens, ``S`` response tokens per suffix, ``N`` responses. The last prompt token
predicts the first response token, so:

* ``baseline``: ``N`` sequences of ``L = P+S-1`` input tokens, ``L(L+1)/2`` causal pairs, LM head at ``S``;
* ``prefixflow``: one prefix of ``P-1`` tokens (forward + backward once, ``(P-1)P/2`` pairs) and ``N``
  suffixes of ``S`` tokens, each reading the ``P-1`` cached keys (``S(P-1) + S(S+1)/2`` pairs), plus one
  element-wise gK/gV accumulation (``2·n_layers·(P-1)·Hkv·hd`` adds) per suffix;
* ``prefix_grouper``: the same GEMM work as ``prefixflow`` without the separate accumulation.

Prefix + suffix pairs equal the baseline's pairs exactly, so the baseline is ``N·(p + s)`` where ``p`` and
``s`` are one trajectory's prefix and suffix work. PrefixFlow costs ``p + N·s + N·a + o`` (``a``: the
accumulation, ``o``: a per-group overhead such as phase switching). Normalising by ``p + s`` gives the
paper's model::

    speedup(N) = 1 / (ŝ + â + p̂/N + ô/N),   ŝ + p̂ = 1,

whose overhead-free limit is ``1/ŝ`` as ``N → ∞`` (``ŝ ≈ 1 - r`` for a large model, ``r = P/(P+S)``).
``overhead`` is ``ô``, expressed in units of one baseline trajectory's FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ModelShape",
    "as_shape",
    "model_flops",
    "ideal_speedup",
    "speedup_terms",
    "flops_breakdown",
    "dense_flops_per_token",
    "record_costs",
    "SYSTEMS",
]

SYSTEMS = ("baseline", "prefixflow", "prefix_grouper")


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
    def linear_macs_per_token(self) -> int:
        """Per-token MACs of all layers' projections and MLPs (no attention scores, no LM head)."""
        d, hd = self.dim, self.head_dim
        proj = 2 * d * self.n_heads * hd + 2 * d * self.n_kv_heads * hd
        return self.n_layers * (proj + 3 * d * self.hidden_dim)

    @property
    def pair_macs(self) -> int:
        """MACs per causal (query, key) pair over all layers."""
        return self.n_layers * 2 * self.n_heads * self.head_dim

    @property
    def head_macs(self) -> int:
        """LM-head MACs per scored position."""
        return self.dim * self.vocab_size


def _llama3_hidden(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """TorchTitan llama3 ``FeedForward``'s hidden size for ``hidden_dim = 4·dim``."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def as_shape(args) -> ModelShape:
    """A :class:`ModelShape` from itself, a TorchTitan llama3 ``TransformerModelArgs`` or ``Qwen3ModelArgs``, or
    a Hugging Face dense decoder config (``hidden_size``, ``num_hidden_layers``, ``intermediate_size``, ...)."""
    if isinstance(args, ModelShape):
        return args
    if hasattr(args, "hidden_size") and hasattr(args, "num_hidden_layers"):
        return _hf_shape(args)
    if getattr(args, "moe_enabled", False):
        from harness.costmodel_moe import moe_shape  # the MoE terms (active experts per token)

        return moe_shape(args)
    n_heads = int(args.n_heads)
    n_kv = int(getattr(args, "n_kv_heads", None) or n_heads)
    head_dim = getattr(args, "head_dim", None) or args.dim // n_heads
    hidden = getattr(args, "hidden_dim", None)
    if hidden is None:
        hidden = _llama3_hidden(args.dim, args.multiple_of, getattr(args, "ffn_dim_multiplier", None))
    return ModelShape(
        dim=int(args.dim),
        n_layers=int(args.n_layers),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=int(head_dim),
        hidden_dim=int(hidden),
        vocab_size=int(args.vocab_size),
    )


def _hf_shape(config) -> ModelShape:
    if getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None):
        raise ValueError("MoE models are not covered by the dense cost model")
    n_heads = int(config.num_attention_heads)
    return ModelShape(
        dim=int(config.hidden_size),
        n_layers=int(config.num_hidden_layers),
        n_heads=n_heads,
        n_kv_heads=int(getattr(config, "num_key_value_heads", None) or n_heads),
        head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // n_heads),
        hidden_dim=int(config.intermediate_size),
        vocab_size=int(config.vocab_size),
    )


def _check_lengths(P: int, S: int, N: int) -> None:
    if P < 1 or S < 1 or N < 1:
        raise ValueError(f"need P >= 1, S >= 1, N >= 1; got P={P}, S={S}, N={N}")


def _train_flops(shape: ModelShape, tokens: int, pairs: int, scored: int) -> int:
    """Forward + backward FLOPs (= 3 · 2 · MACs) of a trained span."""
    macs = tokens * shape.linear_macs_per_token + pairs * shape.pair_macs + scored * shape.head_macs
    return 6 * macs


def flops_breakdown(shape, P: int, S: int) -> dict[str, int]:
    """One trajectory's training FLOPs split at the KV boundary.

    ``prefix``: the ``P-1`` cached tokens; ``suffix``: the ``S`` suffix tokens (attention to the cached
    keys included, LM head included); ``accum``: one suffix's element-wise gK/gV accumulation.
    """
    shape = as_shape(shape)
    _check_lengths(P, S, 1)
    p_tok = P - 1
    prefix = _train_flops(shape, p_tok, p_tok * (p_tok + 1) // 2, 0)
    suffix = _train_flops(shape, S, S * p_tok + S * (S + 1) // 2, S)
    accum = 2 * shape.n_layers * p_tok * shape.n_kv_heads * shape.head_dim
    return {"prefix": prefix, "suffix": suffix, "accum": accum}


def model_flops(system: str, shape, P: int, S: int, N: int) -> int:
    """Training FLOPs (forward + backward) of one rollout group under ``system``."""
    shape = as_shape(shape)
    _check_lengths(P, S, N)
    if system == "baseline":
        L = P + S - 1
        return N * _train_flops(shape, L, L * (L + 1) // 2, S)
    b = flops_breakdown(shape, P, S)
    if system == "prefixflow":
        return b["prefix"] + N * (b["suffix"] + b["accum"])
    if system == "prefix_grouper":
        return b["prefix"] + N * b["suffix"]
    raise ValueError(f"unknown system {system!r}; expected one of {SYSTEMS}")


def speedup_terms(shape, P: int, S: int) -> dict[str, float]:
    """The normalised terms ``p̂, ŝ, â`` of the speedup model (``p̂ + ŝ = 1``)."""
    b = flops_breakdown(shape, P, S)
    total = b["prefix"] + b["suffix"]
    return {"p": b["prefix"] / total, "s": b["suffix"] / total, "a": b["accum"] / total}


def ideal_speedup(shape, P: int, S: int, N: int, overhead: float = 0.0) -> float:
    """``1 / (ŝ + â + p̂/N + ô/N)``: baseline FLOPs over PrefixFlow FLOPs plus ``overhead`` per group.

    ``overhead`` (``ô``) is the per-group cost in units of one baseline trajectory's FLOPs.
    """
    if overhead < 0:
        raise ValueError(f"overhead must be >= 0, got {overhead}")
    _check_lengths(P, S, N)
    t = speedup_terms(shape, P, S)
    return 1.0 / (t["s"] + t["a"] + (t["p"] + overhead) / N)


def dense_flops_per_token(shape, seq_len: int, causal: bool = False) -> float:
    """Per-token training FLOPs of plain full-sequence training with the LM head at every position.

    With ``causal=False`` this is TorchTitan's ``get_dense_model_nparams_and_flops`` convention
    (``6·(non-embedding params) + 12·n_layers·H·hd·seq_len``), for cross-checking.
    """
    shape = as_shape(shape)
    pairs = seq_len * seq_len if not causal else seq_len * (seq_len + 1) // 2
    return _train_flops(shape, seq_len, pairs, seq_len) / seq_len


def record_costs(system: str, shape, P: int, S: int, N: int, overhead: float = 0.0) -> dict[str, float]:
    """The cost-model columns of one record: ``model_flops`` of ``system`` and the group's ``ideal_speedup``."""
    return {
        "model_flops": float(model_flops(system, shape, P, S, N)),
        "ideal_speedup": ideal_speedup(shape, P, S, N, overhead=overhead),
    }
