"""Hugging Face causal LMs under PrefixFlow: gradients equal the same HF model trained on full sequences.

The reference is transformers' own ``model(input_ids).logits`` (sdpa), one full sequence ``[P || S_i]`` at a
time, loss computed by hand; nothing of PrefixFlow runs in it. q/k projections are scaled up and norm weights
randomised, so a RoPE position or convention error moves the gradients far beyond the tolerance.

Stock HF RMSNorm computes in fp32 even in fp64 models, which bounds fp64 agreement near 1e-7: the target is
1e-6 there, and 1e-10 with the norms computing in fp64 (``fp64_norms``), which isolates the schedule.
"""

from __future__ import annotations

import pytest
import torch
from support.reference import max_rel_diff

pytest.importorskip("transformers")

import prefixflow as pf  # noqa: E402
from prefixflow.integrations import hf  # noqa: E402

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# Families beyond the first four (issue 24): Gemma (scaled embeddings, (1 + w) norms), Gemma-3 (qk-norm,
# sliding/global layers, query_pre_attn_scalar), Phi (partial RoPE, LayerNorm, biased LM head), Phi-3 (fused
# qkv / gate_up), OLMo (non-parametric LayerNorm), OLMo-2 (post-norm, full-width qk-norm), StableLM, StarCoder2,
# Helium.
MORE_FAMILIES = ("gemma", "gemma3", "phi", "phi3", "olmo", "olmo2", "stablelm", "starcoder2", "helium")
VOCAB = 256


def make_model(family: str, dtype=torch.float64, seed: int = 0, tied: bool = False, **overrides):
    """A tiny HF model (hidden 64, 2 layers, 4 query heads over 2 KV heads) with attention-heavy weights."""
    model = hf.build_hf_model(
        f"{family}-tiny", dtype=dtype, seed=seed, overrides={"tie_word_embeddings": tied, **overrides}
    )
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            for name in ("q_proj", "k_proj", "qkv_proj"):  # Phi-3 fuses q/k/v (v scaled too: harmless)
                if hasattr(layer.self_attn, name):
                    getattr(layer.self_attn, name).weight.mul_(6.0)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
    return model


def fp64_norms(model) -> None:
    """Make every RMSNorm of ``model`` compute in the model's dtype (instance-level; no package edits)."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):

            def forward(x, m=module):
                variance = x.pow(2).mean(-1, keepdim=True)
                eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
                return m.weight * (x * torch.rsqrt(variance + eps))

            module.forward = forward


def loss_scale(group) -> float:
    """The size of a loss='pg' value before its terms cancel: (1/N) sum_i |A_i| log V. Zero-mean advantages
    make the loss itself small, so loss errors are measured against this."""
    return float(group.advantages.abs().mean()) * torch.log(torch.tensor(float(VOCAB))).item()


def reference_pg(model, group) -> tuple[float, list[torch.Tensor]]:
    """loss='pg' on full sequences through the plain HF forward; returns the loss and every gradient."""
    model.zero_grad(set_to_none=True)
    total, p = 0.0, group.prompt_len
    for i, response in enumerate(group.responses):
        seq = torch.cat([group.prompt, response[:-1]]).unsqueeze(0)
        logits = model(input_ids=seq).logits[0, p - 1 :]
        logp = torch.log_softmax(logits.double(), dim=-1).gather(-1, response.unsqueeze(-1)).squeeze(-1)
        loss = -(group.advantages[i].double() * logp.mean()) / group.n
        loss.backward()
        total += loss.item()
    return total, [param.grad.detach().clone() for param in model.parameters()]


def grads(model) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters()]


GROUP = pf.synthetic_group(VOCAB, 29, [7, 16, 3, 11], seed=3)


@pytest.mark.parametrize("family", FAMILIES + MORE_FAMILIES)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fp64_matches_full_sequences(family, tied):
    model = make_model(family, tied=tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert model.config.model_type in hf.VERIFIED_MODEL_TYPES
    want_loss, want = reference_pg(model, GROUP)
    pf.apply_prefixflow(model)
    for layout in ("padded", "packed"):
        for microbatch in (None, 1):
            model.zero_grad(set_to_none=True)
            stats = pf.train_group(model, GROUP, layout=layout, microbatch=microbatch)
            assert abs(stats.loss - want_loss) <= 1e-6 * abs(want_loss), (layout, microbatch)
            assert max_rel_diff(grads(model), want) <= 1e-6, (layout, microbatch)
            assert set(stats.phase_times) == {"A", "B", "C"}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fp64_norms_isolate_the_schedule(family):
    """With the norms in fp64 the only difference left is summation order: 1e-10, both systems."""
    model = make_model(family)
    fp64_norms(model)
    group = pf.synthetic_group(VOCAB, 40, [5, 12, 30, 21], seed=4)
    want_loss, want = reference_pg(model, group)
    pf.apply_prefixflow(model)
    for system in ("prefixflow", "baseline"):
        for layout, microbatch in (("padded", 2), ("packed", None)):
            model.zero_grad(set_to_none=True)
            stats = pf.train_group(model, group, system=system, layout=layout, microbatch=microbatch)
            assert abs(stats.loss - want_loss) <= 1e-12 * abs(want_loss)
            assert max_rel_diff(grads(model), want) <= 1e-10, (system, layout)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fp32_matches_full_sequences(family):
    model = make_model(family, dtype=torch.float32)
    want_loss, want = reference_pg(model, GROUP)
    pf.apply_prefixflow(model)
    for layout in ("padded", "packed"):
        model.zero_grad(set_to_none=True)
        stats = pf.train_group(model, GROUP, layout=layout, microbatch=1)
        assert abs(stats.loss - want_loss) <= 1e-5 * loss_scale(GROUP)
        assert max_rel_diff(grads(model), want) <= 1e-5


def test_grpo_loss_and_gradient_checkpointing():
    """loss='grpo' with KL, under HF's own (non-reentrant) gradient checkpointing: equal to no checkpointing."""
    group = pf.synthetic_group(VOCAB, 17, [6, 9, 4], seed=5, with_logprobs=True)
    cfg = {"kl_coef": 0.1, "clip_eps_high": 0.28}
    plain = pf.apply_prefixflow(make_model("qwen3"))
    plain.train()
    pf.train_group(plain, group, loss="grpo", loss_config=cfg, system="baseline")
    want = grads(plain)
    ckpt = pf.apply_ac(pf.apply_prefixflow(make_model("qwen3")), "full")
    assert all(layer.gradient_checkpointing for layer in ckpt.model.layers)
    pf.train_group(ckpt, group, loss="grpo", loss_config=cfg, layout="packed", microbatch=1)
    assert max_rel_diff(grads(ckpt), want) <= 1e-6


def test_plain_forward_and_generation_unchanged():
    """Outside train_group the model is transformers' sdpa model: padded batches, masks, cache, generate."""
    model = make_model("qwen3", dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    before = model(input_ids=ids, attention_mask=mask).logits
    out_before = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    pf.apply_prefixflow(model)
    assert model.config._attn_implementation == hf.ATTENTION_NAME
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, before)
    assert torch.equal(
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False), out_before
    )
    assert "prefixflow" not in model.config.to_json_string()  # a saved config loads without PrefixFlow
    assert not any("prefixflow" in name for name, _ in model.named_modules())
    assert pf.apply_prefixflow(model) is model  # idempotent


def test_nothing_survives_a_group():
    model = pf.apply_prefixflow(make_model("llama"))
    pf.train_group(model, GROUP, layout="packed", microbatch=2)
    runtime = model._prefixflow
    assert runtime.state.mode is None
    assert all(w.prefix_kv is None for w in runtime.state.wrappers)
    assert runtime.n_wrapped == 2 and len(runtime.state.wrappers) == 2
    for p in model.parameters():
        assert p.grad is not None and p.grad.grad_fn is None


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_sliding_window_shorter_than_the_group_is_exact(family):
    """Paths of up to 45 tokens under a 12-token window (Mistral: every layer; Gemma-3: its local layers): each
    query, suffix queries over the cached prefix included, sees only the keys inside its window."""
    local = {"layer_types": ["sliding_attention", "full_attention"]} if family == "gemma3" else {}
    model = make_model(family, sliding_window=12, **local)
    fp64_norms(model)
    want_loss, want = reference_pg(model, GROUP)
    pf.apply_prefixflow(model)
    windows = pf.adapter_for(model).windows(model)
    assert windows and set(windows.values()) == {12}
    assert len(windows) == (2 if family == "mistral" else 1)  # Gemma-3 tiny: one local, one global layer
    for system, layout, microbatch in (("prefixflow", "padded", 2), ("prefixflow", "packed", None),
                                       ("baseline", "packed", 2)):  # fmt: skip
        model.zero_grad(set_to_none=True)
        stats = pf.train_group(model, GROUP, system=system, layout=layout, microbatch=microbatch)
        assert abs(stats.loss - want_loss) <= 1e-12 * abs(want_loss), (system, layout)
        assert max_rel_diff(grads(model), want) <= 1e-10, (system, layout)


def test_invalid_input_raises_before_gradients_change():
    model = pf.apply_prefixflow(make_model("mistral", sliding_window=48))
    pf.train_group(model, GROUP)
    before = [g.clone() for g in grads(model)]
    bad_token = pf.RolloutGroup(torch.tensor([1, 2, VOCAB]), [torch.tensor([3])], torch.tensor([1.0]))
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        pf.train_group(model, bad_token)
    hf.enable_checkpointing(model, use_reentrant=True)
    model.train()
    with pytest.raises(ValueError, match="use_reentrant"):
        pf.train_group(model, GROUP)
    assert all(torch.equal(a, b) for a, b in zip(grads(model), before, strict=True))


def test_unsupported_models_are_refused_with_the_fix():
    eager = hf.build_hf_model("llama-tiny")
    eager.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        pf.apply_prefixflow(eager)
    granite = hf.build_hf_model("llama-tiny")
    granite.config.model_type = "granite"  # unverified: its forward divides the logits by logits_scaling
    with pytest.raises(ValueError, match="verified on model types .* A type needs decoder layers"):
        pf.apply_prefixflow(granite)
    scaled = hf.build_hf_model("llama-tiny")
    scaled.config.logits_scaling = 8.0
    with pytest.raises(ValueError, match="logits_scaling"):
        pf.apply_prefixflow(scaled)
    phi = pf.apply_prefixflow(hf.build_hf_model("phi-tiny", overrides={"resid_pdrop": 0.1}))
    phi.train()
    with pytest.raises(ValueError, match="config.resid_pdrop must be 0"):
        pf.train_group(phi, GROUP)
    short = pf.apply_prefixflow(hf.build_hf_model("llama-tiny", overrides={"max_position_embeddings": 16}))
    with pytest.raises(
        ValueError, match=r"max_position_embeddings=16; .*overrides=\{'max_position_embeddings'"
    ):
        pf.train_group(short, GROUP)  # issue 26.6: HF's field, not TorchTitan's max_seq_len
    with pytest.raises(ValueError, match="more than the model's max_position_embeddings=16"):
        pf.train_group(short, GROUP.as_tree())
    with pytest.raises(ValueError, match="selective"):
        pf.apply_ac(hf.build_hf_model("llama-tiny"), "selective")
    with pytest.raises(ValueError, match="neither a built-in config"):
        hf.build_hf_model("no-such-model")
    with pytest.raises(ValueError, match="unknown override field"):
        hf.build_hf_model("llama-tiny", overrides={"n_layers": 2})


def test_local_config_path(tmp_path):
    config = hf.hf_config("qwen2-tiny")
    config.save_pretrained(tmp_path)
    model = hf.build_hf_model(str(tmp_path), seed=7, overrides={"num_hidden_layers": 1})
    assert model.config.model_type == "qwen2" and len(model.model.layers) == 1
    again = hf.build_hf_model(str(tmp_path / "config.json"), seed=7, overrides={"num_hidden_layers": 1})
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))


def test_entry_point_finds_the_adapter_without_an_import():
    """An installed prefixflow announces the HF adapter; apply_prefixflow needs no integration import."""
    from importlib import metadata

    if not any(
        e.value == "prefixflow.integrations.hf" for e in metadata.entry_points(group="prefixflow.adapters")
    ):
        pytest.skip("the installed prefixflow metadata predates the entry point: reinstall (make setup)")
    code = (
        "import sys, torch, transformers, prefixflow as pf\n"
        "cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,"
        " num_attention_heads=2, vocab_size=64)\n"
        "m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation='sdpa')\n"
        "assert 'prefixflow.integrations.hf' not in sys.modules\n"
        "pf.apply_prefixflow(m)\n"
        "print(type(pf.adapter_for(m)).__name__)\n"
    )
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "HFAdapter"
