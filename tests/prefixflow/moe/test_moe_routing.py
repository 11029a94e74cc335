"""Live routing (when it diverges between the systems), the balance loss, the bias update, validation."""

from __future__ import annotations

import contextlib

import pytest
import torch
from support.moe import VOCAB, grads, one_thread, random_routing, reference_replay, tiny_moe, with_routing
from support.reference import max_rel_diff, reference_pg

import prefixflow as pf
from prefixflow.moe import MoEConfig, moe_hooks_of, moe_layers, record_routing, tokens_per_expert

TOL = 1e-9
__all__ = ["one_thread"]  # the module's autouse fixture


def group_for(seed: int, prompt_len: int = 13, lens=(5, 7, 1, 4)) -> pf.RolloutGroup:
    return pf.synthetic_group(VOCAB, prompt_len, list(lens), seed=seed)


def both_systems(model, group, **kw) -> dict[str, list[torch.Tensor]]:
    out = {}
    for system in ("baseline", "prefixflow"):
        model.zero_grad(set_to_none=True)
        pf.train_group(model, group, system=system, **kw)
        out[system] = [g.clone() for g in grads(model)]
    return out


# -- live (unreplayed) routing ------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_live_dropless_routing_is_exact_in_fp64(layout):
    """Top-k is a per-token function of a hidden state both systems compute to ~1e-16: away from ties the
    systems route identically, so live routing gives the plain model's gradients."""
    model = tiny_moe()
    for seed in range(2):
        group = group_for(seed)
        _, want = reference_pg(model, group)
        for microbatch in (None, 1):
            got = both_systems(model, group, layout=layout, microbatch=microbatch)
            assert max_rel_diff(got["prefixflow"], want) <= TOL
            assert max_rel_diff(got["baseline"], want) <= TOL


def test_routing_flips_at_a_tie():
    """Why live routing is exact only away from ties: when a token's k-th and (k+1)-th logits tie, a change
    of its hidden state at the level of the systems' rounding differences changes its experts."""
    router = moe_layers(tiny_moe())[0].router
    x = torch.randn(1, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x[0, 0] = 0.0
    picks = []
    with torch.no_grad():
        order = router.gate(x)[0].argsort(descending=True)
        kth, below = order[router.top_k - 1], order[router.top_k]
        router.gate.weight[below] = router.gate.weight[kth]
        router.gate.weight[below, 0] += 1.0  # logit(below) - logit(kth) = x[0]
        for x0 in (-1e-14, 1e-14):
            x[0, 0] = x0
            _, selected, _, _ = router(x)
            picks.append(set(selected[0].tolist()))
    assert picks[0] != picks[1] and len(picks[0] & picks[1]) == router.top_k - 1


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_capacity_limited_routing_diverges(layout):
    """Token dropping depends on the other tokens of a forward: the baseline's forward holds N copies of
    the prefix plus suffixes, PrefixFlow's Phase A the prefix alone; the systems drop different tokens."""
    model = tiny_moe(config=MoEConfig(capacity_factor=1.0))
    group = group_for(1, prompt_len=17, lens=(9, 9, 9, 9))
    got = both_systems(model, group, layout=layout)
    assert max_rel_diff(got["prefixflow"], got["baseline"]) > 1e-3


def test_capacity_limited_routing_is_rejected_with_replay():
    model = tiny_moe(config=MoEConfig(capacity_factor=1.25))
    group = group_for(2)
    group = with_routing(group, random_routing(group, 2, 8, 2, seed=2))
    with pytest.raises(ValueError, match="capacity_factor=1.25.*dropless"):
        pf.train_group(model, group)
    assert all(p.grad is None for p in model.parameters())


class BiasUpdateEachMicrobatch(pf.ScheduleHooks):
    """A per-microbatch (per-batch) expert-bias update, as a trainer updating inside accumulation would do."""

    def __init__(self, model) -> None:
        self.model = model

    @contextlib.contextmanager
    def microbatch(self, mb):
        yield
        for layer in moe_layers(self.model):
            layer.load_balance_coeff = 0.1
        pf.update_expert_bias(self.model)


def test_per_batch_bias_update_diverges():
    """The baseline routes the prefix again in every microbatch under an updated bias; PrefixFlow routed it
    once in Phase A under the first bias."""
    got = {}
    for system in ("baseline", "prefixflow"):
        model = tiny_moe()
        pf.add_hooks(model, BiasUpdateEachMicrobatch(model))
        pf.train_group(model, group_for(3, prompt_len=21), system=system, microbatch=1)
        got[system] = grads(model)
    assert max_rel_diff(got["prefixflow"], got["baseline"]) > 1e-3


@pytest.mark.parametrize("replay", [False, True])
def test_per_step_bias_update_is_identical(replay):
    """TorchTitan's update at the optimizer step reads counters that count each prefix token N times in
    both systems: identical counters, identical biases, identical next-step routing."""
    biases, counters = {}, {}
    for system in ("baseline", "prefixflow"):
        model = tiny_moe()
        for step in range(2):
            group = group_for(10 + step)
            if replay:
                group = with_routing(group, record_routing(model, group))
            pf.train_group(model, group, system=system, layout="padded", microbatch=2)
            counters[(system, step)] = tokens_per_expert(model)
            pf.update_expert_bias(model)
        biases[system] = torch.stack([layer.expert_bias for layer in moe_layers(model)])
    for step in range(2):
        assert torch.equal(counters[("baseline", step)], counters[("prefixflow", step)])
    assert torch.equal(biases["baseline"], biases["prefixflow"])
    assert biases["baseline"].abs().sum() > 0


# -- auxiliary balance loss ---------------------------------------------------------------------------------
@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_aux_loss_is_exact_in_fp64(ac, layout):
    """PrefixFlow counts each cached prefix token N times in the balance loss (logical prefix-token
    accounting), so loss and gradients equal the reference's over the N full sequences."""
    coef = 0.5  # large, so a wrong prefix weight shows far above 1e-9
    model = tiny_moe(ac=ac, config=MoEConfig(aux_loss_coef=coef))
    group = group_for(4)
    group = with_routing(group, record_routing(model, group))
    want_pg, want_aux, want = reference_replay(model, group, aux_coef=coef)
    _, _, without_aux = reference_replay(model, group)
    assert max_rel_diff(without_aux, want) > 1e-3  # the balance loss moves the gradients
    for system in ("baseline", "prefixflow"):
        for microbatch in (None, 1):
            model.zero_grad(set_to_none=True)
            stats = pf.train_group(model, group, system=system, layout=layout, microbatch=microbatch)
            aux = moe_hooks_of(model).aux_loss
            assert abs(stats.loss - want_pg) <= TOL * max(1.0, abs(want_pg))
            assert abs(aux - want_aux) <= TOL * max(1.0, abs(want_aux)), (system, aux, want_aux)
            assert max_rel_diff(grads(model), want) <= TOL, (system, microbatch)


def test_aux_loss_needs_routing_masks():
    model = tiny_moe(config=MoEConfig(aux_loss_coef=0.01))
    with pytest.raises(ValueError, match="aux_loss_coef needs group.routing.*record_routing"):
        pf.train_group(model, group_for(5))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"aux_loss_coef": -1.0}, "aux_loss_coef must be a finite number >= 0"),
        ({"aux_loss_coef": float("nan")}, "aux_loss_coef"),
        ({"capacity_factor": 0}, "capacity_factor must be None"),
        ({"capacity_factor": True}, "capacity_factor"),
    ],
)
def test_moe_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(**kwargs)


# -- routing masks validation -------------------------------------------------------------------------------
def _masks(group, layers=2, k=2, experts=8, seed=0):
    return random_routing(group, layers, experts, k, seed)


@pytest.mark.parametrize(
    "mutate, error, match",
    [
        (
            lambda r: setattr(r, "prefix", r.prefix[:, :-1]),
            ValueError,
            r"routing.prefix has shape .*\(2, 13, 2\)",
        ),
        (lambda r: r.suffixes.pop(), ValueError, "routing.suffixes must be a list of 4"),
        (
            lambda r: r.suffixes.__setitem__(1, r.suffixes[1][:, :2]),
            ValueError,
            r"routing.suffixes\[1\] has shape",
        ),
        (
            lambda r: r.suffixes.__setitem__(0, r.suffixes[0][:1]),
            ValueError,
            r"routing.suffixes\[0\] has shape",
        ),
        (
            lambda r: r.prefix.__setitem__((0, 0, 0), -1),
            ValueError,
            "routing.prefix has a negative expert id",
        ),
        (lambda r: setattr(r, "prefix", r.prefix.float()), TypeError, "routing.prefix must hold integer"),
        (lambda r: setattr(r, "prefix", r.prefix[0]), ValueError, "routing.prefix must be 3-D"),
        (lambda r: setattr(r, "prefix", r.prefix.to("meta")), ValueError, "routing.prefix is on the meta"),
        (
            lambda r: r.suffixes[3].__setitem__((1, 0), torch.tensor([3, 3])),
            ValueError,
            r"routing.suffixes\[3\] routes a token to the same expert twice",
        ),
    ],
)
def test_bad_routing_masks_are_rejected_on_construction(mutate, error, match):
    group = group_for(6)
    routing = _masks(group)
    mutate(routing)
    with pytest.raises(error, match=match):
        with_routing(group, routing)


@pytest.mark.parametrize(
    "routing_kw, match",
    [
        ({"layers": 3}, "routing.prefix has masks for 3 MoE layers; the model has 2"),
        ({"k": 3}, "top-3 experts; the model routes top-2"),
        ({"experts": 9, "seed": 1}, r"expert id 8 outside the model's experts \[0, 8\)"),
    ],
)
def test_routing_that_does_not_fit_the_model_is_rejected_before_any_gradient(routing_kw, match):
    model = tiny_moe()
    group = group_for(7)
    group = with_routing(group, _masks(group, **routing_kw))
    for system in ("prefixflow", "baseline"):
        with pytest.raises(ValueError, match=match):
            pf.train_group(model, group, system=system)
    assert all(p.grad is None for p in model.parameters())
    assert float(tokens_per_expert(model).sum()) == 0


def test_routing_set_after_construction_is_still_checked():
    model = tiny_moe()
    group = group_for(8)
    group.routing = pf.RoutingMasks(torch.zeros(2, 3, 2, dtype=torch.long), [])
    with pytest.raises(ValueError, match="routing.prefix has shape"):
        pf.train_group(model, group)


def test_routing_on_a_dense_model_is_rejected():
    from conftest import tiny_model

    model = tiny_model("qwen3")
    group = group_for(9)
    with pytest.raises(ValueError, match="group.routing replays MoE expert choices.*no MoE layers"):
        pf.train_group(model, with_routing(group, _masks(group)))
