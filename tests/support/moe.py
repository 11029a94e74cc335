"""Tiny Qwen3-MoE shapes and an independent full-sequence reference with routing replay."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import prefixflow as pf
from prefixflow.moe import RoutePlan, moe_layers

VOCAB = 97


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """MoE layers run many tiny ops; on a loaded 2-core machine a second intra-op thread costs 10-100x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# 2 layers, dim 64, 8 experts top-2, GQA 4/2: every layer is MoE (Qwen3's debugmodel_moe layout).
TINY_MOE = {
    "dim": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "head_dim": 16,
    "vocab_size": VOCAB,
    "moe_inter_dim": 32,
    "moe_args.num_experts": 8,
    "moe_args.top_k": 2,
}


def tiny_moe(dtype=torch.float64, ac: str = "none", seed: int = 0, config=None, **extra):
    model = pf.build_model("qwen3:debugmodel_moe", dtype=dtype, seed=seed, overrides={**TINY_MOE, **extra})
    if config is not None:
        pf.apply_moe(model, config)
    pf.apply_ac(model, ac)
    return pf.apply_prefixflow(model)


def random_routing(group: pf.RolloutGroup, n_layers: int, num_experts: int, k: int, seed: int):
    """Masks unrelated to the trainer's router (an inference engine's routing differs from training's)."""
    gen = torch.Generator().manual_seed(seed)

    def masks(rows: int) -> torch.Tensor:
        ids = [torch.randperm(num_experts, generator=gen)[:k] for _ in range(n_layers * rows)]
        return (
            torch.stack(ids).view(n_layers, rows, k) if ids else torch.zeros(n_layers, 0, k, dtype=torch.long)
        )

    return pf.RoutingMasks(masks(group.prompt_len), [masks(n - 1) for n in group.response_lens])


def with_routing(group: pf.RolloutGroup, routing) -> pf.RolloutGroup:
    return dataclasses.replace(group, routing=routing)


def grads(model) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters()]


def reference_replay(model, group: pf.RolloutGroup, aux_coef: float = 0.0):
    """-(1/N) sum_i A_i mean_t log pi(s_it) (+ the balance loss), one plain ``model(tokens)`` per sequence,
    each MoE layer replaying the sequence's masks. The balance loss is computed here from the router logits
    (captured by forward hooks) and the masks: alpha * E * sum_e f_e * P_e over the N full sequences.

    Returns (pg loss, aux loss, grads); the model's grads are zeroed first.
    """
    model.zero_grad(set_to_none=True)
    layers = moe_layers(model)
    num_experts = layers[0].router.num_experts
    routing = group.routing
    p = group.prompt_len
    seq_masks = [torch.cat([routing.prefix, s], dim=1) for s in routing.suffixes]
    tokens = sum(m.shape[1] for m in seq_masks)
    k = routing.top_k
    fraction = [
        torch.stack([torch.bincount(m[layer].reshape(-1), minlength=num_experts) for m in seq_masks])
        .sum(0)
        .double()
        / (tokens * k)
        for layer in range(len(layers))
    ]
    logits: list[torch.Tensor] = []
    handles = [
        layer.router.gate.register_forward_hook(lambda mod, inp, out: logits.append(out)) for layer in layers
    ]
    pg_total = aux_total = 0.0
    try:
        for i, response in enumerate(group.responses):
            for layer, plan_rows in zip(layers, seq_masks[i], strict=True):
                layer.route_plan = RoutePlan(shape=(1, plan_rows.shape[0]), experts=plan_rows.unsqueeze(0))
            logits.clear()
            seq = torch.cat([group.prompt, response]).unsqueeze(0)
            out = model(seq[:, :-1])[0, p - 1 :]
            logp = torch.log_softmax(out.double(), dim=-1).gather(-1, response.unsqueeze(-1)).squeeze(-1)
            pg = -(group.advantages[i].double() * logp.mean()) / group.n
            aux = sum(
                aux_coef * num_experts * (torch.softmax(lg.double(), dim=-1).sum(0) * f).sum() / tokens
                for lg, f in zip(logits, fraction, strict=True)
            )
            (pg + aux).backward()
            pg_total += pg.item()
            aux_total += float(aux.detach()) if torch.is_tensor(aux) else aux
    finally:
        for h in handles:
            h.remove()
        for layer in layers:
            layer.route_plan = None
    return pg_total, aux_total, [param.grad.detach().clone() for param in model.parameters()]
