"""FLOPs of one rollout group on a hybrid model (Qwen3.5 gated DeltaNet; Nemotron-H Mamba-2), as each system
executes it through transformers 5.24's PyTorch reference paths.

The counting rules are :mod:`harness.costmodel.flops`' (a trained GEMM costs 3x its forward, SDPA pairs as each
call computes them), applied op by op to what runs. A matmul's backward computes a gradient only for the
operands that require one, and only the ops the loss (or a Phase-C root) reaches run backward.

**Per layer.** A decoder layer is a token mixer and an MLP (Qwen3.5: both; Nemotron-H: one of attention,
Mamba-2 or MLP per block). The MLP is ``6·dim·inter`` per token (SwiGLU; Nemotron-H's relu² ``4·dim·inter``).
Attention is the dense model's, with Qwen3.5's q projection twice as wide (its output gate). A recurrent mixer
runs its projections on the rows it is given, its depthwise causal convolution (kernel ``K``, over the ``L``
inputs, or ``L + K - 1`` after a cached tail, padded by ``K - 1``: ``2·C_conv·K·(L_in + K - 1)`` per row and
direction), and its chunked kernel, which pads every row to a multiple of its chunk ``C`` (GDN: 64, the
kernel's default; Mamba-2: ``config.chunk_size``), so a row of ``L`` tokens runs ``nc = ceil(L / C)`` chunks:

* GDN (``torch_chunk_gated_delta_rule``; per row and value head): ``k_beta·kᵀ`` and ``q·kᵀ`` (``2·C²·dk`` each
  per chunk), two unitriangular solves (``C(C-1)·dv`` and ``C(C-1)·dk``, not seen by FlopCounterMode), and per
  chunk four state matmuls: ``k_cumdecay·S``, ``q·S``, ``kᵀ·v_new`` (``2·C·dk·dv`` each) and
  ``attn·v_new`` (``2·C²·dv``). Backward: every matmul twice, except that the first chunk's ``k_cumdecay·S``
  and ``q·S`` have no state gradient from the zero state, the last chunk's state update is not reached
  unless the end state is a Phase-C root, and each solve's backward is one solve and one ``2·C²·d`` matmul.
  Its one-token recurrent variant never runs in training (a one-token call from a state is padded to two).
* Mamba-2 (``mamba2_chunk_scan``; per row): five einsums, ``C·B`` (``2·nc·C²·h·n``), ``M·x``
  (``2·nc·C²·h·p``), the chunk states (``2·nc·C·h·n·p``), the chunk recurrence (``2·(nc+1)²·h·p·n``) and
  ``C·states`` (``2·nc·C·h·n·p``); backward twice each.

The gated norms, l2 norms, gates, decays, ``exp``/``cumsum`` and RoPE are elementwise and not counted, as the
dense model counts no norm; neither FlopCounterMode nor the model sees them.

**What runs.** ``baseline``: each microbatch of ``[P || S_i[:-1]]`` forward and backward; a packed row's
recurrent mixers run its segments as a right-padded batch (``n`` segments x the longest). ``prefixflow``: Phase
A runs the ``P - 1`` cached tokens up to the last boundary layer (attention or recurrent), which runs its
q/k/v projections (attention) or its whole mixer (recurrent) and stops there; Phase C's backward starts at every
boundary (K/V, end state, conv tail), so in the last boundary layer it reaches only k/v (attention) or the
input projections, the convolution and the state half of the kernel (recurrent: not ``q·kᵀ``, ``q·S``,
``attn·v_new``, the z projection or the output projection). Phase B runs each suffix microbatch from the
cached state (padded ``b x w``, packed: its segments), a one-token width padded to two.
:func:`least_hybrid_flops` is PrefixFlow one response at a time, causal pairs only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .work import Flops, causal_pairs, microbatches, response_lengths, suffix_pairs

__all__ = [
    "Attention",
    "GatedDeltaNet",
    "Mamba2",
    "HybridLayer",
    "HybridShape",
    "hybrid_shape",
    "executed_hybrid_flops",
    "least_hybrid_flops",
    "hybrid_ops",
    "hybrid_paper_terms",
    "HYBRID_MODEL_TYPES",
]

HYBRID_MODEL_TYPES = ("qwen3_5_text", "nemotron_h")
_OPS = ("mm", "bmm", "conv", "solve", "sdpa")


@dataclass(frozen=True)
class Attention:
    q_out: int  # q_proj's output features (Qwen3.5: 2·H·hd, query and output gate)
    kv_out: int  # each of k_proj and v_proj
    o_in: int
    heads: int
    kv_heads: int
    head_dim: int

    def proj(self, dim: int) -> int:
        return 2 * dim * (self.q_out + 2 * self.kv_out + self.o_in)


@dataclass(frozen=True)
class GatedDeltaNet:
    key_heads: int
    value_heads: int
    dk: int
    dv: int
    kernel: int
    chunk: int = 64

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_heads * self.dk + self.value_heads * self.dv

    def proj(self, dim: int) -> int:  # in_proj_qkv, z, b, a; out_proj
        v = self.value_heads * self.dv
        return 2 * dim * (self.conv_dim + v + 2 * self.value_heads) + 2 * v * dim

    def state_proj(self, dim: int) -> int:  # the projections the end state and the tail depend on
        return 2 * dim * (self.conv_dim + 2 * self.value_heads)

    def kernel_ops(self, rows: int, length: int, initial: bool, output: bool, final: bool) -> dict[str, int]:
        C, dk, dv, h = self.chunk, self.dk, self.dv, self.value_heads
        nc = math.ceil(length / C)
        mm_s, mm_q, mm_a = 2 * C * dk * dv, 2 * C * dk * C, 2 * C * C * dv  # one chunk, one head
        fwd = nc * (2 * mm_q + 3 * mm_s + mm_a)
        states_reached = nc if final else nc - 1  # chunks whose state update the backward reaches
        first = 0 if initial else 1  # the zero state takes no gradient
        # k_beta·kᵀ, k_cumdecay·S (reached through the output or the next state), kᵀ·v_new
        bwd = 2 * nc * mm_q + (2 * nc - first) * mm_s + 2 * states_reached * mm_s
        if output:
            bwd += 2 * nc * mm_q + (2 * nc - first) * mm_s + 2 * nc * mm_a  # q·kᵀ, q·S, attn·v_new
        bwd += nc * 2 * C * C * (dk + dv)  # the solves' backward matmuls
        solve = nc * C * (C - 1) * (dk + dv)
        return {
            "bmm": rows * h * (fwd + bwd),
            "solve": 2 * rows * h * solve,
            **self._conv(rows, length, initial),
        }

    def _conv(self, rows: int, length: int, initial: bool) -> dict[str, int]:
        out = length + (self.kernel - 1 if initial else 0) + self.kernel - 1
        return {"conv": 3 * 2 * rows * self.conv_dim * self.kernel * out}


@dataclass(frozen=True)
class Mamba2(GatedDeltaNet):
    """Mamba-2 (Nemotron-H's mixer): ``key_heads`` = groups, ``value_heads`` = heads, ``dk`` = state size,
    ``dv`` = head dim."""

    @property
    def conv_dim(self) -> int:
        return self.value_heads * self.dv + 2 * self.key_heads * self.dk

    def proj(self, dim: int) -> int:  # in_proj (gate, x|B|C, dt); out_proj
        inner = self.value_heads * self.dv
        return 2 * dim * (inner + self.conv_dim + self.value_heads) + 2 * inner * dim

    def state_proj(self, dim: int) -> int:
        return 2 * dim * (self.value_heads * self.dv + self.conv_dim + self.value_heads)

    def kernel_ops(self, rows: int, length: int, initial: bool, output: bool, final: bool) -> dict[str, int]:
        C, n, p, h = self.chunk, self.dk, self.dv, self.value_heads
        nc = math.ceil(length / C)
        state = 2 * nc * C * h * n * p + 2 * (nc + 1) ** 2 * h * p * n  # chunk states, chunk recurrence
        out = 2 * nc * C * C * h * (n + p) + 2 * nc * C * h * n * p  # C·B, M·x, C·states
        work = 3 * state + (3 * out if output else out)
        return {"bmm": rows * work, "solve": 0, **self._conv(rows, length, initial)}


@dataclass(frozen=True)
class HybridLayer:
    mixer: Attention | GatedDeltaNet | None  # None: an MLP-only block
    mlp: int  # forward GEMM FLOPs per token of the layer's MLP (0: none)


@dataclass(frozen=True)
class HybridShape:
    """The dimensions that set a hybrid decoder's FLOPs: its layers in order, width and vocabulary."""

    dim: int
    vocab_size: int
    hidden_dim: int  # the MLPs' intermediate size
    layers: tuple[HybridLayer, ...]
    systems = ("baseline", "prefixflow")

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def _first_attention(self) -> Attention | None:
        return next((layer.mixer for layer in self.layers if isinstance(layer.mixer, Attention)), None)

    @property
    def n_heads(self) -> int | None:
        a = self._first_attention()
        return a.heads if a else None

    @property
    def n_kv_heads(self) -> int | None:
        a = self._first_attention()
        return a.kv_heads if a else None

    @property
    def head_dim(self) -> int | None:
        a = self._first_attention()
        return a.head_dim if a else None

    @property
    def last_boundary(self) -> int:
        return max(i for i, layer in enumerate(self.layers) if layer.mixer is not None)


def hybrid_shape(config) -> HybridShape:
    """The :class:`HybridShape` of a Hugging Face Qwen3.5 text or Nemotron-H config."""
    kind = getattr(config, "model_type", "")
    types = list(getattr(config, "layer_types", None) or ())
    dim = int(config.hidden_size)
    unknown = sorted(set(types) - {"full_attention", "linear_attention", "mlp"})
    if kind not in HYBRID_MODEL_TYPES or unknown or len(types) != int(config.num_hidden_layers):
        raise ValueError(
            f"the hybrid cost model covers {list(HYBRID_MODEL_TYPES)} with attention, linear_attention and mlp "
            f"layers; got model_type {kind!r} with layer types {sorted(set(types))}"
        )
    heads, kv_heads, hd = (
        int(config.num_attention_heads),
        int(config.num_key_value_heads),
        int(config.head_dim),
    )
    qwen = kind == "qwen3_5_text"
    attention = Attention(heads * hd * (2 if qwen else 1), kv_heads * hd, heads * hd, heads, kv_heads, hd)
    mlp = (6 if qwen else 4) * dim * int(config.intermediate_size)
    if qwen:
        recurrent = GatedDeltaNet(
            int(config.linear_num_key_heads), int(config.linear_num_value_heads),
            int(config.linear_key_head_dim), int(config.linear_value_head_dim),
            int(config.linear_conv_kernel_dim),
        )  # fmt: skip
    else:
        recurrent = Mamba2(
            int(config.n_groups), int(config.mamba_num_heads), int(config.ssm_state_size),
            int(config.mamba_head_dim), int(config.conv_kernel), int(config.chunk_size),
        )  # fmt: skip
    mixers = {"full_attention": attention, "linear_attention": recurrent, "mlp": None}
    layers = tuple(HybridLayer(mixers[t], mlp if qwen or t == "mlp" else 0) for t in types)
    return HybridShape(dim, int(config.vocab_size), int(config.intermediate_size), layers)


# -- executed work --------------------------------------------------------------------------------------


def _add(total: dict[str, int], part: dict[str, int]) -> None:
    for k, v in part.items():
        total[k] += v


def _trained(shape: HybridShape, slots: int, rows: tuple[int, int], pairs: int, scored: int, initial: bool):
    """Forward + backward of one microbatch: ``slots`` token slots through attention and MLPs, ``rows`` (n, L)
    through the recurrent mixers (from the cached state when ``initial``), ``pairs`` per attention layer."""
    ops = dict.fromkeys(_OPS, 0)
    n, length = rows
    if initial and length == 1:  # HFRecurrentRule pads a one-token call from a state to two tokens
        length = 2
    for layer in shape.layers:
        ops["mm"] += 3 * slots * layer.mlp
        m = layer.mixer
        if isinstance(m, Attention):
            ops["mm"] += 3 * slots * m.proj(shape.dim)
            ops["sdpa"] += 3 * pairs * 4 * m.heads * m.head_dim
        elif m is not None:
            ops["mm"] += 3 * n * length * m.proj(shape.dim)
            _add(ops, m.kernel_ops(n, length, initial, output=True, final=False))
    ops["mm"] += 3 * scored * 2 * shape.dim * shape.vocab_size
    return ops


def _prefix(shape: HybridShape, T: int) -> dict[str, int]:
    """Phase A (up to the last boundary layer) and Phase C (backward from every boundary)."""
    ops = dict.fromkeys(_OPS, 0)
    if T == 0:
        return ops
    last = shape.last_boundary
    for i, layer in enumerate(shape.layers[: last + 1]):
        m, dim = layer.mixer, shape.dim
        if i < last:
            ops["mm"] += 3 * T * layer.mlp
        if isinstance(m, Attention):
            if i < last:
                ops["mm"] += 3 * T * m.proj(dim)
                ops["sdpa"] += 3 * causal_pairs(T) * 4 * m.heads * m.head_dim
            else:  # q/k/v forward, k/v backward
                ops["mm"] += 2 * T * dim * (m.q_out + 2 * m.kv_out) + 2 * 2 * T * dim * 2 * m.kv_out
        elif m is not None:
            if i < last:
                ops["mm"] += 3 * T * m.proj(dim)
            else:
                ops["mm"] += T * m.proj(dim) + 2 * T * m.state_proj(dim)
            _add(ops, m.kernel_ops(1, T, initial=False, output=i < last, final=True))
    return ops


def _check(P: int, layout: str, attention: str) -> None:
    if P < 1:
        raise ValueError(f"need P >= 1, got P={P}")
    if layout not in ("padded", "packed") or attention not in ("split", "concat"):
        raise ValueError(
            f"layout must be padded|packed and attention split|concat, got {layout}, {attention}"
        )


def hybrid_ops(
    system: str, shape: HybridShape, P: int, S, N: int | None = None, *, layout="padded", microbatch=None,
    attention="split",
) -> dict[str, int]:  # fmt: skip
    """:func:`executed_hybrid_flops` by op: ``mm`` (linear layers, LM head), ``bmm`` (the chunked kernels'
    matmuls and einsums), ``conv``, ``solve`` (GDN's triangular solves) and ``sdpa`` (attention pairs)."""
    lens = response_lengths(S, N)
    _check(P, layout, attention)
    ops = dict.fromkeys(_OPS, 0)
    if system == "baseline":
        for chunk in microbatches(len(lens), microbatch):
            seqs = [P + lens[i] - 1 for i in chunk]
            rows = (len(seqs), max(seqs))
            if layout == "packed":  # one row, block-diagonal mask: every pair is computed
                slots, pairs = sum(seqs), sum(seqs) ** 2
            else:
                slots, pairs = len(seqs) * max(seqs), len(seqs) * causal_pairs(max(seqs))
            _add(ops, _trained(shape, slots, rows, pairs, sum(lens[i] for i in chunk), initial=False))
        return ops
    if system != "prefixflow":
        raise ValueError(f"the hybrid cost model covers systems {HybridShape.systems}, got {system!r}")
    T = P - 1
    _add(ops, _prefix(shape, T))
    for chunk in microbatches(len(lens), microbatch):
        widths = [lens[i] for i in chunk]
        b, w = len(widths), max(widths)
        slots = sum(widths) if layout == "packed" else b * w
        pairs = suffix_pairs(T, widths, layout, attention)
        _add(ops, _trained(shape, slots, (b, w), pairs, sum(widths), initial=T > 0))
    return ops


def _flops(ops: dict[str, int]) -> Flops:
    return Flops(ops["mm"], ops["sdpa"], ops["bmm"] + ops["conv"] + ops["solve"])


def executed_hybrid_flops(
    system: str, shape: HybridShape, P: int, S, N: int | None = None, **kwargs
) -> Flops:
    """Training FLOPs of one group on a hybrid as ``system`` (``baseline`` or ``prefixflow``) executes it;
    the arguments are :func:`~harness.costmodel.flops.executed_flops`'."""
    return _flops(hybrid_ops(system, shape, P, S, N, **kwargs))


def least_hybrid_flops(shape: HybridShape, P: int, S, N: int | None = None) -> Flops:
    """The least work of the PrefixFlow schedule on a hybrid: one response at a time (no pad slots), causal
    pairs only; the chunked kernels still pad to their chunk, as they do in every schedule."""
    return executed_hybrid_flops("prefixflow", shape, P, S, N, microbatch=1)


def hybrid_paper_terms(shape: HybridShape, P: int, S: int) -> tuple[int, int, int]:
    """The paper's §3.1 terms on a hybrid, unnormalised: one trajectory's prefix trained through every layer,
    its suffix from the boundary, and the boundary's gradient accumulation (gK/gV; state and conv tail)."""
    T = P - 1
    prefix = _flops(_trained(shape, T, (1, T), causal_pairs(T), 0, initial=False)).total if T else 0
    suffix = _flops(_trained(shape, S, (1, S), S * T + causal_pairs(S), S, initial=T > 0)).total
    accum = 0
    for layer in shape.layers:
        m = layer.mixer
        if isinstance(m, Attention):
            accum += 2 * T * m.kv_out
        elif m is not None and T:
            accum += m.value_heads * m.dk * m.dv + m.conv_dim * (m.kernel - 1)
    return prefix, suffix, accum
