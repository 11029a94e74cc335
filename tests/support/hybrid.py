"""Tiny hybrid Hugging Face models (Qwen3.5 gated DeltaNet; Mamba-2: Nemotron-H, Granite-4 hybrid, Bamba), their
fp64 patch, and the
independent full-sequence reference the hybrid tests compare PrefixFlow with.

The reference runs transformers' own base model on one full sequence ``[P || S_i]`` at a time (no cache, no
PrefixFlow mode: ``apply_prefixflow``'s hooks then call the installed code), applies the output embeddings and
computes ``loss='pg'`` by hand.

transformers computes parts of these models in fp32 even in an fp64 model: the RMSNorms, the gated norm, the
gate's ``.float()`` and the chunked/recurrent kernels. :func:`fp64_kernels` patches those to the model's dtype
for a test (pytest's ``monkeypatch``: the installed files are untouched, the patch is undone after the test),
by rewriting ``float32`` / ``.float()`` in the functions' own source, so what runs is still their code.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import textwrap

import pytest
import torch
from packaging.version import Version

from prefixflow.integrations.hf_state import HYBRID_MIN_TRANSFORMERS

VOCAB = 97

# The hybrid tests' mark: PrefixFlow refuses recurrent-state models on older transformers (docs/gpu.md).
VERIFIED_TRANSFORMERS = pytest.mark.skipif(
    Version(importlib.metadata.version("transformers")) < Version(HYBRID_MIN_TRANSFORMERS),
    reason=f"hybrid models need transformers >= {HYBRID_MIN_TRANSFORMERS}",
)


def qwen3_5(layer_types, *, seed: int = 0, dtype=torch.float64, decay=(0.05, 0.5)):
    """A tiny ``Qwen3_5ForCausalLM``: hidden 32, attention 4 query heads over 2 KV heads (head 8), gated
    DeltaNet 2 key heads over 4 value heads (GQA), conv kernel 4, random norm weights. ``decay``: the range of
    the GDN decay rates ``A`` (HF's init draws 0.01..16, which underflows its fp32 kernels within a few tokens)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=list(layer_types), max_position_embeddings=512, attention_dropout=0.0,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5ForCausalLM._from_config(config, attn_implementation="sdpa").to(dtype)
    _randomise(model, seed, decay)
    return model


def nemotron_h(layer_types, *, seed: int = 0, dtype=torch.float64):
    """A tiny ``NemotronHForCausalLM``: hidden 32, Mamba-2 with 4 heads of 8 over 2 groups, state 8, conv 4,
    chunk 8 (so the scan crosses chunk boundaries), attention 4 query heads over 2 KV heads, relu2 MLP blocks."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32, layers_block_type=list(layer_types), num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=64, ssm_state_size=8, mamba_num_heads=4,
        mamba_head_dim=8, n_groups=2, conv_kernel=4, chunk_size=8, max_position_embeddings=512,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = NemotronHForCausalLM._from_config(config, attn_implementation="sdpa").to(dtype)
    _randomise(model, seed, None)
    return model


_MAMBA2 = dict(
    vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
    mamba_n_heads=4, mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=8,
    max_position_embeddings=512,
)  # fmt: skip


def granite_hybrid(layer_types, *, seed: int = 0, dtype=torch.float64, **fields):
    """A tiny dense Granite-4 hybrid (``GraniteMoeHybridForCausalLM``, ``num_local_experts=0``, RoPE): the Mamba-2
    shape of :func:`nemotron_h`'s, a shared MLP in every layer, Granite's embedding/residual/attention
    multipliers at their defaults."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    fields = {
        "num_local_experts": 0,
        "shared_intermediate_size": 64,
        "position_embedding_type": "rope",
        **fields,
    }
    config = GraniteMoeHybridConfig(
        **_MAMBA2, num_hidden_layers=len(layer_types), layer_types=list(layer_types), **fields
    )
    return _built(GraniteMoeHybridForCausalLM, config, seed, dtype)


def bamba(attention_layers, n_layers: int, *, seed: int = 0, dtype=torch.float64):
    """A tiny ``BambaForCausalLM``: Mamba-2 layers with attention at ``attention_layers``."""
    from transformers import BambaConfig, BambaForCausalLM

    config = BambaConfig(**_MAMBA2, num_hidden_layers=n_layers, attn_layer_indices=list(attention_layers))
    return _built(BambaForCausalLM, config, seed, dtype)


def _built(cls, config, seed, dtype):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls._from_config(config, attn_implementation="sdpa").to(dtype)
    _randomise(model, seed, None)
    return model


def _randomise(model, seed: int, decay) -> None:
    """Random norm weights, larger q/k projections and (GDN) decay rates in ``decay``."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(4.0)
            elif name.endswith("A_log") and decay is not None:
                low, high = decay
                a = low + (high - low) * torch.rand(param.shape, generator=gen, dtype=param.dtype)
                param.copy_(a.log())


def reference_pg(model, group) -> tuple[float, list[torch.Tensor]]:
    """loss='pg' on full sequences through HF's own base model and output embeddings; loss and gradients."""
    model.zero_grad(set_to_none=True)
    total, p = 0.0, group.prompt_len
    head = model.get_output_embeddings()
    for i, response in enumerate(group.responses):
        seq = torch.cat([group.prompt, response[:-1]]).unsqueeze(0)
        hidden = model.base_model(input_ids=seq, use_cache=False).last_hidden_state
        logits = head(hidden[0, p - 1 :])
        logp = torch.log_softmax(logits.double(), dim=-1).gather(-1, response.unsqueeze(-1)).squeeze(-1)
        loss = -(group.advantages[i].double() * logp.mean()) / group.n
        loss.backward()
        total += loss.item()
    return total, [param.grad.detach().clone() for param in model.parameters()]


def loss_scale(group) -> float:
    """(1/N) sum_i |A_i| log V: the size of a pg loss before its terms cancel (loss errors are relative to it)."""
    return float(group.advantages.abs().mean()) * float(torch.log(torch.tensor(float(VOCAB))))


def worst_grad(model, want: list[torch.Tensor]) -> tuple[float, str]:
    """max over parameters of max|g - ref| / max|ref| (a missing gradient counts as 1), and its name."""
    worst, name = 0.0, ""
    for (n, param), ref in zip(model.named_parameters(), want, strict=True):
        got = torch.zeros_like(ref) if param.grad is None else param.grad
        scale = ref.abs().max().item()
        d = (got - ref).abs().max().item() / scale if scale else (got - ref).abs().max().item()
        if d > worst:
            worst, name = d, n
    return worst, name


# -- fp64 everywhere: rewrite HF's fp32 casts in their own source (tests only) --------------------------------
_FP32 = (("torch.float32", "torch.float64"), (".float()", ".double()"))
_PATCHED = {
    "transformers.models.qwen3_5.modeling_qwen3_5": {
        "classes": ("Qwen3_5RMSNorm", "Qwen3_5RMSNormGated", "Qwen3_5GatedDeltaNet"),
        "functions": ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
    },
    "transformers.models.nemotron_h.modeling_nemotron_h": {
        # transformers 5.17 has no NemotronHRMSNormGated: its mixer imports zamba2's gated norm
        "classes": (
            "NemotronHRMSNorm",
            ("NemotronHRMSNormGated", "Zamba2RMSNormGated"),
            "NemotronHMamba2Mixer",
        ),
        "functions": ("mamba2_chunk_scan", "mamba2_selective_state_update"),
    },
    "transformers.models.granitemoehybrid.modeling_granitemoehybrid": {
        "classes": ("GraniteMoeHybridRMSNorm", "GraniteMoeHybridRMSNormGated", "GraniteMoeHybridMambaLayer"),
        "functions": ("mamba2_chunk_scan", "mamba2_selective_state_update"),
    },
    "transformers.models.bamba.modeling_bamba": {
        "classes": ("BambaRMSNorm", "BambaRMSNormGated", "BambaMixer"),
        "functions": ("mamba2_chunk_scan", "mamba2_selective_state_update"),
    },
}


def _recompiled(func, namespace: dict):
    """``func`` compiled again from its source with every fp32 cast made fp64 (decorators dropped)."""
    source = textwrap.dedent(inspect.getsource(inspect.unwrap(func)))
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("def "))
    source = "\n".join(lines[start:])
    for old, new in _FP32:
        source = source.replace(old, new)
    scope: dict = {}
    exec(compile(source, f"<fp64 {func.__qualname__}>", "exec"), namespace, scope)  # noqa: S102
    return scope[func.__name__]


def fp64_kernels(monkeypatch) -> None:
    """Patch (for one test) the fp32 casts of the hybrid families' norms, gates and kernels to fp64."""
    import importlib

    for module_name, names in _PATCHED.items():
        module = importlib.import_module(module_name)
        for name in names["functions"]:
            monkeypatch.setattr(module, name, _recompiled(getattr(module, name), vars(module)))
        for name in names["classes"]:  # a tuple: the class's names across transformers versions
            cls = next(
                getattr(module, n)
                for n in (name if isinstance(name, tuple) else (name,))
                if hasattr(module, n)
            )
            home = importlib.import_module(cls.__module__)  # where its forward's globals live
            monkeypatch.setattr(cls, "forward", _recompiled(cls.forward, vars(home)))
