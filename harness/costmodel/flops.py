"""FLOPs of one rollout group as each system executes it, the ideal PrefixFlow speedup, and a FLOP counter.

**What runs** (:func:`executed_flops`, dense decoder, activation checkpointing off). Counted are GEMMs (the
projections, the SwiGLU MLP and the LM head) and attention (``QKᵀ`` and ``PV``); norms, RoPE, softmax and the
loss are not. A trained GEMM costs 3x its forward (``dX`` and ``dW``), and so does attention (FlashAttention's
backward: ``dP, dV, dQ, dK``).

* GEMM forward per token and layer: ``2·dim·(H + 2·Hkv)·hd`` (q, k, v), ``2·H·hd·dim`` (o), ``6·dim·hidden``
  (MLP); the LM head ``2·dim·vocab`` only at the positions that predict a response token. Padded layouts pay
  for every token slot, pads included.
* attention forward: ``4·H·hd`` per (query, key) pair and layer, over the pairs the kernel really computes:
  ``L(L+1)/2`` for a causal call (``is_causal``: the kernel skips the upper triangle), but **every** ``Lq·Lk``
  pair under an explicit mask (the masked kernel cannot skip what the mask hides).
* ``baseline``: each microbatch of ``[P || S_i[:-1]]`` sequences forward and backward (causal when padded,
  block-diagonal mask when packed).
* ``prefixflow``: Phase A runs the ``P-1`` cached tokens through layers ``0..L-2`` and only the q/k/v
  projections of the last layer (it stops after the last K/V). Phase C's backward starts at the K/V of
  every layer, so it never reaches the last layer's prefix ``wo``, MLP, attention or ``wq``: it runs the
  last layer's ``wk``/``wv`` backward and layers ``0..L-2`` fully. Phase B: the suffix microbatches (split:
  the prefix part is ``S·(P-1)`` pairs, the suffix part causal when padded or a packed row holds one
  response; concat: one masked call over ``S·(P-1+S)`` pairs).
* ``prefix_grouper``: one packed graph of ``P + Σ(S_i - 1)`` tokens through every layer; its prefix call is
  causal, its suffix call a masked ``[N, S_max-1]`` x ``P + S_max-1`` call.

**The ideal speedup** (:func:`ideal_speedup`) is the baseline's executed FLOPs over the least work the
PrefixFlow schedule must do (the above with causal pairs only, no padding). :func:`paper_ideal_speedup` is the
paper's §3.1 model, ``1 / (ŝ + â + p̂/N)``, which charges the prefix forward and backward in every layer: it
is a lower bound that PrefixFlow can beat by the dead last-layer work (a third of the baseline on 2 layers).

**Vision-language models** (Qwen2.5-VL): a :class:`~harness.costmodel.vision.VisionShape` adds the vision
tower to the language model's work, once per group under PrefixFlow and once per sequence under the baseline
(:mod:`harness.costmodel.vision`).

**Hybrids** (Qwen3.5 gated DeltaNet, Nemotron-H Mamba-2): :func:`as_shape` of their config is a
:class:`~harness.costmodel.hybrid.HybridShape`, and every function here hands it to
:mod:`harness.costmodel.hybrid` (baseline and PrefixFlow; PrefixGrouper does not run them).

**Counting** (:func:`count_flops`, :mod:`harness.costmodel.counting`): dispatch counters, torch's
``flop_registry`` formulas for the GEMMs (``mm/addmm``) and the recurrent kernels' batched matmuls
(``bmm/baddbmm``), own formulas for attention (FlopCounterMode ignores causality), grouped convolutions and
triangular solves. None of them keeps a tensor alive or changes a kernel (FlopCounterMode does both).
"""

from __future__ import annotations

from collections.abc import Sequence

from harness.costmodel.counting import AttentionCounter, count_flops, count_ops
from harness.costmodel.hybrid import (
    HYBRID_MODEL_TYPES,
    HybridShape,
    executed_hybrid_flops,
    hybrid_paper_terms,
    hybrid_shape,
    least_hybrid_flops,
)
from harness.costmodel.moe import moe_shape
from harness.costmodel.shape import ModelShape
from harness.costmodel.vision import VisionShape, tower_flops, tower_work
from harness.costmodel.work import Flops, suffix_pairs
from harness.costmodel.work import causal_pairs as _causal
from harness.costmodel.work import microbatches as _chunks
from harness.costmodel.work import response_lengths as _lens

__all__ = [
    "Flops",
    "as_shape",
    "executed_flops",
    "model_flops",
    "ideal_speedup",
    "paper_ideal_speedup",
    "speedup_terms",
    "dense_flops_per_token",
    "AttentionCounter",
    "count_flops",
    "count_ops",
    "SYSTEMS",
]

SYSTEMS = ("baseline", "prefixflow", "prefix_grouper")


def _llama3_hidden(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """TorchTitan llama3 ``FeedForward``'s hidden size for ``hidden_dim = 4·dim``."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def as_shape(args) -> ModelShape:
    """A :class:`ModelShape` from itself, a TorchTitan llama3 ``TransformerModelArgs`` or ``Qwen3ModelArgs``, or
    a Hugging Face dense decoder config (``hidden_size``, ``num_hidden_layers``, ``intermediate_size``, ...)."""
    if isinstance(args, (ModelShape, HybridShape, VisionShape)):
        return args
    if hasattr(args, "hidden_size") and hasattr(args, "num_hidden_layers"):
        return _hf_shape(args)
    if getattr(args, "moe_enabled", False):
        return moe_shape(args)  # the MoE terms (active experts per token)
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


def _hf_shape(config) -> ModelShape | HybridShape:
    other = sorted(set(getattr(config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"})
    if getattr(config, "model_type", None) in HYBRID_MODEL_TYPES:
        return hybrid_shape(config)
    if other:  # hybrids the hybrid cost model does not know (Granite-4 hybrid, Bamba, ...)
        raise ValueError(
            f"the cost model does not cover {other} layers of model_type {config.model_type!r}; it covers "
            f"dense decoders and the hybrids {list(HYBRID_MODEL_TYPES)}"
        )
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


# -- executed work --------------------------------------------------------------------------------------


def _trained(shape: ModelShape, slots: int, pairs: int, scored: int) -> Flops:
    """Forward + backward of ``slots`` token slots through every layer, ``pairs`` attention pairs per layer."""
    gemm = 3 * (slots * shape.n_layers * shape.layer + scored * shape.head)
    return Flops(gemm, 3 * pairs * shape.n_layers * shape.pair)


def _baseline(shape, P, lens, layout, microbatch) -> Flops:
    work = Flops(0, 0)
    for chunk in _chunks(len(lens), microbatch):
        seqs = [P + lens[i] - 1 for i in chunk]
        if layout == "packed":  # one row under a block-diagonal mask: every pair of the row is computed
            slots, pairs = sum(seqs), sum(seqs) ** 2
        else:
            slots, pairs = len(seqs) * max(seqs), len(seqs) * _causal(max(seqs))
        work += _trained(shape, slots, pairs, sum(lens[i] for i in chunk))
    return work


def _prefix(shape: ModelShape, T: int) -> Flops:
    """Phase A (stops after the last layer's K/V) and Phase C (backward from every layer's K/V)."""
    if T == 0:
        return Flops(0, 0)
    full = shape.n_layers - 1
    gemm = 3 * T * full * shape.layer + T * (shape.qkv + 2 * shape.kv)
    return Flops(gemm, 3 * full * _causal(T) * shape.pair)


def _prefixflow(shape, P, lens, layout, microbatch, attention) -> Flops:
    T = P - 1
    work = _prefix(shape, T)
    for chunk in _chunks(len(lens), microbatch):
        widths = [lens[i] for i in chunk]
        slots = sum(widths) if layout == "packed" else len(widths) * max(widths)
        work += _trained(shape, slots, suffix_pairs(T, widths, layout, attention), sum(widths))
    return work


def _prefix_grouper(shape, P, lens) -> Flops:
    width = max(1, max(lens) - 1)
    slots = P + sum(s - 1 for s in lens)
    pairs = _causal(P) + len(lens) * width * (P + width)
    return _trained(shape, slots, pairs, sum(lens))


def executed_flops(
    system: str,
    shape,
    P: int,
    S: int | Sequence[int],
    N: int | None = None,
    *,
    layout: str = "padded",
    microbatch: int | None = None,
    attention: str = "split",
) -> Flops:
    """Training FLOPs of one group as ``system`` executes it (see the module doc). ``S``: one length for ``N``
    responses, or the list of response lengths; ``microbatch``: None (all), a size, or the list of sizes a
    ``microbatch="auto"`` plan chose; ``attention``: PrefixFlow's suffix attention variant."""
    shape = as_shape(shape)
    if isinstance(shape, HybridShape):
        return executed_hybrid_flops(
            system, shape, P, S, N, layout=layout, microbatch=microbatch, attention=attention
        )
    lens = _lens(S, N)
    if isinstance(shape, VisionShape):  # the language model's work, plus the tower once or N times
        text = executed_flops(
            system, shape.text, P, lens, layout=layout, microbatch=microbatch, attention=attention
        )
        return text + tower_work(shape, system, len(lens))
    if P < 1:
        raise ValueError(f"need P >= 1, got P={P}")
    if layout not in ("padded", "packed") or attention not in ("split", "concat"):
        raise ValueError(
            f"layout must be padded|packed and attention split|concat, got {layout}, {attention}"
        )
    if system == "baseline":
        return _baseline(shape, P, lens, layout, microbatch)
    if system == "prefixflow":
        return _prefixflow(shape, P, lens, layout, microbatch, attention)
    if system == "prefix_grouper":
        return _prefix_grouper(shape, P, lens)
    raise ValueError(f"unknown system {system!r}; expected one of {SYSTEMS}")


def model_flops(system: str, shape, P: int, S, N: int | None = None, **kwargs) -> int:
    """Total of :func:`executed_flops`."""
    return executed_flops(system, shape, P, S, N, **kwargs).total


def least_prefixflow_flops(shape, P: int, S, N: int | None = None) -> Flops:
    """The least work the PrefixFlow schedule must do: causal pairs only, no pad slots."""
    shape, lens = as_shape(shape), _lens(S, N)
    if isinstance(shape, HybridShape):
        return least_hybrid_flops(shape, P, lens)
    if isinstance(shape, VisionShape):
        return least_prefixflow_flops(shape.text, P, lens) + tower_work(shape, "prefixflow", len(lens))
    T = P - 1
    work = _prefix(shape, T)
    for s in lens:
        work += _trained(shape, s, s * T + _causal(s), s)
    return work


def ideal_speedup(shape, P: int, S, N: int | None = None, *, layout="padded", microbatch=None) -> float:
    """The baseline's executed FLOPs (in this layout and microbatching) over :func:`least_prefixflow_flops`."""
    base = model_flops("baseline", shape, P, S, N, layout=layout, microbatch=microbatch)
    return base / least_prefixflow_flops(shape, P, S, N).total


# -- the paper's §3.1 model -----------------------------------------------------------------------------


def speedup_terms(shape, P: int, S: int) -> dict[str, float]:
    """The paper's normalised terms ``p̂, ŝ, â`` (``p̂ + ŝ = 1``): one trajectory split at the KV boundary, the
    prefix charged its full forward and backward in every layer; ``â``: one suffix's gK/gV accumulation (on a
    hybrid also its state and conv-tail gradient accumulation)."""
    shape = as_shape(shape)
    if P < 1 or S < 1:
        raise ValueError(f"need P >= 1, S >= 1; got P={P}, S={S}")
    T = P - 1
    tower = 0
    if isinstance(shape, VisionShape):  # the tower is prefix work
        tower, shape = tower_flops(shape.tower, shape.grids, shape.trained).total, shape.text
    if isinstance(shape, HybridShape):
        prefix, suffix, accum = hybrid_paper_terms(shape, P, S)
    else:
        prefix = _trained(shape, T, _causal(T), 0).total
        suffix = _trained(shape, S, S * T + _causal(S), S).total
        accum = 2 * shape.n_layers * T * shape.n_kv_heads * shape.head_dim
    prefix += tower
    total = prefix + suffix
    return {"p": prefix / total, "s": suffix / total, "a": accum / total}


def paper_ideal_speedup(shape, P: int, S: int, N: int, overhead: float = 0.0) -> float:
    """The paper's ``1 / (ŝ + â + p̂/N + ô/N)`` (``overhead`` ô in units of one trajectory's FLOPs)."""
    if overhead < 0:
        raise ValueError(f"overhead must be >= 0, got {overhead}")
    if N < 1:
        raise ValueError(f"need N >= 1, got N={N}")
    t = speedup_terms(shape, P, S)
    return 1.0 / (t["s"] + t["a"] + (t["p"] + overhead) / N)


def dense_flops_per_token(shape, seq_len: int, causal: bool = False) -> float:
    """Per-token training FLOPs of plain full-sequence training with the LM head at every position.

    With ``causal=False`` this is TorchTitan's ``get_dense_model_nparams_and_flops`` convention
    (``6·(non-embedding params) + 12·n_layers·H·hd·seq_len``), for cross-checking.
    """
    shape = as_shape(shape)
    if isinstance(shape, HybridShape):
        raise ValueError("dense_flops_per_token is TorchTitan's dense convention; a hybrid has no such count")
    pairs = seq_len * seq_len if not causal else _causal(seq_len)
    return _trained(shape, seq_len, pairs, seq_len).total / seq_len
