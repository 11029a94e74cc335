"""What the recurrent-state cache refuses, by name, before any gradient changes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from support.hybrid import VERIFIED_TRANSFORMERS, VOCAB, granite_hybrid, nemotron_h, qwen3_5  # noqa: E402

import prefixflow as pf  # noqa: E402
from prefixflow.integrations import hf  # noqa: E402
from prefixflow.state import layers as state_layers  # noqa: E402

pytestmark = VERIFIED_TRANSFORMERS

LIN, FULL = "linear_attention", "full_attention"


def test_layer_type_without_rule_is_refused(monkeypatch):
    rules = {k: v for k, v in state_layers._RULES.items() if k != "Qwen3_5GatedDeltaNet"}
    monkeypatch.setattr(state_layers, "_RULES", rules)
    with pytest.raises(
        ValueError, match="no state rule for layer type 'linear_attention'.*Qwen3_5GatedDeltaNet"
    ):
        pf.apply_prefixflow(qwen3_5((FULL, LIN)))


def test_transformers_older_than_the_verified_one_is_refused_for_hybrids(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.17.0")  # the lent GPU machine's
    with pytest.raises(ValueError, match=r"need transformers >= 5\.24\.0, found 5\.17\.0"):
        pf.apply_prefixflow(qwen3_5((FULL, LIN)))


def test_moe_blocks_are_refused():
    with pytest.raises(ValueError, match=r"layer 1 \(layer type 'moe'\) has MoE experts \['NemotronHMoE'\]"):
        pf.apply_prefixflow(nemotron_h((LIN, "moe")))
    model = granite_hybrid(("mamba", "attention"), num_local_experts=2, num_experts_per_tok=1)
    with pytest.raises(ValueError, match=r"has MoE experts \['GraniteMoeHybridMoE'\]"):
        pf.apply_prefixflow(model)


def test_granite_logits_scaling_is_refused():
    """Granite divides its logits by ``logits_scaling`` in the causal-LM forward, outside the LM head PrefixFlow
    applies: a model that sets it is refused rather than trained on other logits."""
    with pytest.raises(ValueError, match="logits_scaling"):
        pf.apply_prefixflow(granite_hybrid(("mamba", "attention"), logits_scaling=4.0))


def test_a_group_with_masks_inside_responses_trains_as_its_tree(monkeypatch):
    """Tool output inside a response (``loss_masks``) on a hybrid: the group trains as its tree, and both
    systems agree to 1e-9 (fp64 kernels)."""
    from support.hybrid import fp64_kernels, worst_grad

    fp64_kernels(monkeypatch)
    model = qwen3_5((LIN, FULL))
    pf.apply_prefixflow(model)
    group = pf.synthetic_group(VOCAB, 5, [3, 4], seed=1)
    masks = [torch.tensor([True, False, True]), torch.ones(4, dtype=torch.bool)]
    tree = pf.RolloutGroup(group.prompt, group.responses, group.advantages, loss_masks=masks)
    want = pf.train_group(model, tree, system="baseline").loss
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    got = pf.train_group(model, tree, layout="packed", microbatch=1).loss
    assert abs(got - want) <= 1e-9 * abs(want) and worst_grad(model, grads)[0] <= 1e-9


def test_build_hf_model_names():
    for name in ("qwen3_5-tiny", "nemotron_h-tiny"):
        model = hf.build_hf_model(name, dtype=torch.float64)
        pf.apply_prefixflow(model)
        stats = pf.train_group(model, pf.synthetic_group(64, 9, [3, 5], seed=2), layout="packed")
        assert stats.prefix_tokens == 8


def test_compiled_blocks_are_refused():
    model = qwen3_5((LIN, FULL))
    pf.apply_prefixflow(model)
    pf.apply_compile(model)
    with pytest.raises(
        ValueError, match=r"compiled blocks do not run recurrent layers \(\['linear_attention'\]\)"
    ):
        pf.train_group(model, pf.synthetic_group(VOCAB, 5, [3, 4], seed=1))
    assert all(p.grad is None for p in model.parameters())


def test_cost_model_covers_qwen3_5_and_nemotron_h_only():
    """pf-bench records cost columns for the hybrids the cost model covers (harness.costmodel.hybrid) and none
    for the others, rather than counting their recurrent layers as attention."""
    from transformers import BambaConfig

    from harness.costmodel.flops import as_shape
    from harness.costmodel.hybrid import HybridShape

    for name in ("qwen3_5-tiny", "nemotron_h-tiny"):
        assert isinstance(as_shape(hf.hf_config(name)), HybridShape)
    with pytest.raises(
        ValueError, match="does not cover \\['linear_attention'\\] layers of model_type 'bamba'"
    ):
        as_shape(BambaConfig(num_hidden_layers=2, attn_layer_indices=[1]))
    assert as_shape(hf.hf_config("qwen3-tiny")).n_layers == 2


def test_pf_bench_cell_on_a_hybrid():
    """pf-bench runs hf:qwen3_5-tiny and records its modelled FLOPs, equal to the counted ones; PrefixGrouper's one
    packed graph would chain the recurrent state from the prefix through every response, so its system fails
    naming the layer instead of training something else."""
    from harness.run.measurement import measure_cell
    from harness.spec.cell import Cell, ModelSpec

    cell = Cell(
        spec="t", model=ModelSpec(name="hf:qwen3_5-tiny"), prefix_len=12, suffix_len=4, n=3, warmup=1, repeats=1,
        systems=("baseline", "prefixflow", "prefix_grouper"), layout="packed",
    )  # fmt: skip
    records = {r["system"]: r for r in measure_cell(cell)}
    assert records["baseline"]["status"] == records["prefixflow"]["status"] == "ok"
    assert records["prefixflow"]["prefix_tokens"] == 11
    for system in ("baseline", "prefixflow"):  # the hybrid cost model: modelled FLOPs equal the counted ones
        rec = records[system]
        for kind in ("", "gemm_", "attention_", "recurrent_"):
            assert rec[f"model_{kind}flops"] == rec[f"counted_{kind}flops"] > 0, (system, kind)
        assert rec["ideal_speedup"] > 1
    assert "model_flops" not in records["prefix_grouper"]
    assert abs(records["prefixflow"]["loss"] - records["baseline"]["loss"]) <= 1e-5
    assert records["prefix_grouper"]["status"] != "ok"
    assert (
        "linear_attention layer (Qwen3_5GatedDeltaNet) does not run under"
        in records["prefix_grouper"]["error"]
    )
