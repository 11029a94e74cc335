"""MoE with Rollout Routing Replay: fp64 exactness of both systems against an independent reference."""

from __future__ import annotations

import pytest
import torch
from support.moe import VOCAB, grads, one_thread, random_routing, reference_replay, tiny_moe, with_routing
from support.reference import max_rel_diff, reference_pg

import prefixflow as pf
from prefixflow.model.models import count_parameters
from prefixflow.moe import moe_layers, record_routing

TOL = 1e-9
__all__ = ["one_thread"]  # the module's autouse fixture


def group_for(seed: int, prompt_len: int = 13, lens=(5, 7, 1, 4)) -> pf.RolloutGroup:
    return pf.synthetic_group(VOCAB, prompt_len, list(lens), seed=seed)


def test_moe_flavours_build_and_run_on_cpu():
    assert {"qwen3:debugmodel_moe", "qwen3:30B-A3B"} <= set(pf.list_models())
    model = tiny_moe(torch.float32)
    layers = moe_layers(model)
    assert len(layers) == 2 and layers[0].router.num_experts == 8 and layers[0].router.top_k == 2
    logits = model(torch.randint(0, VOCAB, (2, 9)))
    logits.sum().backward()
    assert logits.shape == (2, 9, VOCAB)
    assert layers[0].router.gate.weight.grad.abs().sum() > 0
    assert float(layers[0].tokens_per_expert.sum()) == 2 * 9 * 2  # every token counted k times
    big = pf.build_model("qwen3:30B-A3B", device="meta", dtype=torch.bfloat16)
    assert len(moe_layers(big)) == 48 and moe_layers(big)[0].router.num_experts == 128
    assert 30.0e9 < sum(p.numel() for p in big.parameters()) < 31.0e9


def test_moe_overrides_name_the_nested_field():
    with pytest.raises(ValueError, match="moe_args.num_experts"):
        pf.build_model("qwen3:debugmodel_moe", overrides={"moe_args.num_expertz": 4})
    with pytest.raises(ValueError, match="moe_args.top_k"):
        pf.build_model("qwen3:debugmodel_moe", overrides={"moe_args.top_k": "two"})


def _dense_moe(layer, x):
    """sum_k gate_k * expert_k(x) token by token: the MoE layer written without reordering."""
    scores = torch.softmax(layer.router.gate(x).double(), dim=-1)
    top = torch.topk(scores, layer.router.top_k, dim=-1)
    gates = top.values / top.values.sum(-1, keepdim=True)
    w1, w2, w3 = layer.experts.w1, layer.experts.w2, layer.experts.w3
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for g, e in zip(gates[t], top.indices[t], strict=True):
            h = torch.nn.functional.silu(w1[e] @ x[t]) * (w3[e] @ x[t])
            out[t] += g * (w2[e] @ h)
    return out


def test_moe_layer_equals_token_by_token_experts():
    layer = moe_layers(tiny_moe())[0]
    x = torch.randn(1, 11, 64, dtype=torch.float64)
    with torch.no_grad():
        got = layer(x)[0]
        assert float((got - _dense_moe(layer, x[0])).abs().max()) < 1e-14


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("system", ["prefixflow", "baseline"])
def test_replay_matches_independent_reference(ac, layout, system):
    """Masks unrelated to the live router (as an inference engine's would be): both systems replay them."""
    model = tiny_moe(ac=ac)
    for seed in range(2):
        group = group_for(seed)
        group = with_routing(group, random_routing(group, 2, 8, 2, seed=seed))
        want_loss, _, want = reference_replay(model, group)
        for microbatch in (None, 1):
            model.zero_grad(set_to_none=True)
            stats = pf.train_group(model, group, system=system, layout=layout, microbatch=microbatch)
            assert abs(stats.loss - want_loss) <= TOL * max(1.0, abs(want_loss))
            assert max_rel_diff(grads(model), want) <= TOL, (seed, microbatch)
            assert all(layer.route_plan is None for layer in moe_layers(model))


def test_replay_trains_the_router_from_live_logits():
    model = tiny_moe()
    group = group_for(3)
    group = with_routing(group, random_routing(group, 2, 8, 2, seed=3))
    pf.train_group(model, group)
    gate = moe_layers(model)[0].router.gate.weight.grad
    assert gate is not None and float(gate.abs().max()) > 0


def test_recorded_masks_replay_the_live_routing_and_route_the_prefix_once():
    model = tiny_moe()
    group = group_for(4)
    routed = []
    handle = moe_layers(model)[0].router.gate.register_forward_hook(lambda m, i, o: routed.append(o.shape[0]))
    routing = record_routing(model, group)
    handle.remove()
    # P-1 prefix tokens once, then each suffix [P[-1], S_i[:-1]].
    assert sum(routed) == group.prompt_len - 1 + sum(group.response_lens)
    assert routing.prefix.shape == (2, group.prompt_len, 2)
    assert [s.shape[1] for s in routing.suffixes] == [n - 1 for n in group.response_lens]
    # Replaying the recorded masks is the live routing: the plain model's full-sequence gradients.
    want_loss, want = reference_pg(model, group)
    for system in ("prefixflow", "baseline"):
        model.zero_grad(set_to_none=True)
        stats = pf.train_group(model, with_routing(group, routing), system=system, layout="packed")
        assert abs(stats.loss - want_loss) <= TOL * max(1.0, abs(want_loss))
        assert max_rel_diff(grads(model), want) <= TOL


def test_one_token_prompt_and_one_token_responses_replay():
    model = tiny_moe()
    for prompt_len, lens in ((1, (3, 5)), (9, (1, 1, 2))):
        group = group_for(5, prompt_len, lens)
        group = with_routing(group, record_routing(model, group, microbatch=1))
        _, _, want = reference_replay(model, group)
        for system in ("prefixflow", "baseline"):
            model.zero_grad(set_to_none=True)
            pf.train_group(model, group, system=system, microbatch=1)
            assert max_rel_diff(grads(model), want) <= TOL


def test_tokens_are_counted_logically_in_both_systems():
    """Every prefix token counts N times in PrefixFlow (once per sequence in the baseline); pads never."""
    counts = {}
    for system in ("prefixflow", "baseline"):
        for layout in ("padded", "packed"):
            model = tiny_moe()
            group = group_for(7)
            for routing in (None, record_routing(model, group)):
                g = group if routing is None else with_routing(group, routing)
                for layer in moe_layers(model):
                    layer.tokens_per_expert.zero_()
                pf.train_group(model, g, system=system, layout=layout, microbatch=2)
                counts[(system, layout, routing is None)] = pf.moe.tokens_per_expert(model)
    tokens = group.n * group.prompt_len + sum(n - 1 for n in group.response_lens)
    for c in counts.values():
        assert torch.equal(c, counts[("baseline", "packed", True)])
        assert float(c[0].sum()) == tokens * 2


def test_offload_changes_no_number_under_replay():
    """Offloaded prefix saved tensors (expert ids stay resident as integer tensors) give bitwise gradients."""
    group = group_for(9)
    group = with_routing(group, random_routing(group, 2, 8, 2, seed=9))
    got = []
    for offload in (False, True):
        model = tiny_moe()
        pf.apply_prefixflow(model, pf.PrefixFlowConfig(offload=offload))
        stats = pf.train_group(model, group, microbatch=1)
        got.append([g.clone() for g in grads(model)])
        assert not offload or stats.offload.offloaded_bytes > 0
    assert all(torch.equal(a, b) for a, b in zip(*got, strict=True))


def test_alignment_refuses_copies_that_cannot_fit_before_building_any(monkeypatch):
    """`pf-bench align --model qwen3:debugmodel_moe --dtype fp64` at full size (316M parameters) needs ~28 GiB
    for its two copies: a one-line error naming the fix, not an OOM kill a minute later."""
    from prefixflow.checks import alignment

    def built(*args, **kwargs):
        raise AssertionError("a model was built before the memory check")

    monkeypatch.setattr(alignment, "_available_bytes", lambda: 16 * 2**30)
    monkeypatch.setattr(alignment, "build_model", built)
    with pytest.raises(
        ValueError, match=r"316M parameters: 2 trained copies in fp64 need about 28\.\d GiB.*--override"
    ):
        alignment.run_alignment("qwen3:debugmodel_moe", dtype=torch.float64)
    assert count_parameters("qwen3:debugmodel_moe") == 315_758_848  # as built
