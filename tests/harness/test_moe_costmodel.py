"""The MoE cost model: active parameters per token, and FLOPs that match what the MoE layer executes."""

from __future__ import annotations

import pytest
import torch
from support.moe import one_thread, tiny_moe
from torch.utils.flop_counter import FlopCounterMode

import prefixflow as pf
from harness.costmodel import flops
from harness.costmodel.moe import MoEShape, active_params_per_token, moe_shape, total_params
from prefixflow.moe import RoutePlan, moe_layers

__all__ = ["one_thread"]  # the module's autouse fixture


def _non_norm_params(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if "norm" not in n)


def test_qwen3_30b_a3b_has_3b_active_of_30b_parameters():
    model = pf.build_model("qwen3:30B-A3B", device="meta", dtype=torch.bfloat16)
    shape = flops.as_shape(pf.model_args(model))
    assert isinstance(shape, MoEShape) and shape.hidden_dim == 8 * 768
    assert total_params(shape) == _non_norm_params(model)  # every expert of every layer, untied head
    assert 3.3e9 < active_params_per_token(shape) < 3.4e9  # the "A3B"


def test_tiny_moe_parameter_count_and_shape_validation():
    model = tiny_moe()
    shape = moe_shape(pf.model_args(model))
    tied = model.output.weight is model.tok_embeddings.weight
    assert total_params(shape, tied=tied) == _non_norm_params(model)
    with pytest.raises(ValueError, match="top_k <= num_experts"):
        MoEShape(64, 2, 4, 2, 16, 64, 97, num_experts=2, top_k=3, moe_inter_dim=32)
    with pytest.raises(ValueError, match="active FFN width 64"):
        MoEShape(64, 2, 4, 2, 16, 96, 97, num_experts=8, top_k=2, moe_inter_dim=32)


def test_moe_layer_flops_are_the_router_and_the_active_experts():
    """FlopCounterMode's GEMMs (mm/addmm: router and expert matmuls) over one MoE layer equal the model's
    per-token FFN term times the tokens; the gate-weighted combine (a bmm) is not a GEMM of the model."""
    model = tiny_moe()
    layer = moe_layers(model)[0]
    shape = moe_shape(pf.model_args(model))
    tokens = 37
    x = torch.randn(1, tokens, shape.dim, dtype=torch.float64)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        layer(x)
    counts = counter.get_flop_counts()["Global"]
    gemm = sum(v for op, v in counts.items() if op.__name__.split(".")[0] in ("mm", "addmm"))
    ffn = shape.layer - shape.attention_projections
    assert gemm == tokens * ffn


def test_replayed_routing_costs_what_live_routing_costs():
    model = tiny_moe()
    layer = moe_layers(model)[0]
    x = torch.randn(1, 9, 64, dtype=torch.float64)
    replay = torch.stack([torch.randperm(8)[:2] for _ in range(9)]).unsqueeze(0)
    flops = []
    for plan in (None, RoutePlan(shape=(1, 9), experts=replay)):
        layer.route_plan = plan
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            layer(x)
        flops.append(counter.get_total_flops())
    layer.route_plan = None
    assert flops[0] == flops[1]


def test_ideal_speedup_of_an_moe_model_follows_prefix_reuse():
    shape = flops.as_shape(pf.model_args(tiny_moe()))
    low = flops.ideal_speedup(shape, 256, 1280, 16)
    high = flops.ideal_speedup(shape, 1280, 256, 16)
    assert 1.0 < low < high < 6.0
