"""fp64: TRL 1.16's other policy terms (``LossConfig.policy`` cispo / sapo / vespo, the off-policy sequence mask,
luspo's ``seq-mean-token-sum`` with sequence ratios) on prefix trees: PrefixFlow's tree schedule, the
full-sequence baseline on the same paths and an independent per-path reference agree to <= 1e-9.

The reference runs one plain ``model(tokens)`` per path and writes each term out by hand from TRL's
``GRPOTrainer._compute_loss`` (no prefixflow loss code)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_model
from support.reference import max_rel_diff
from support.tree_reference import random_tree

import prefixflow as pf

TOL = 1e-9
POLICIES = {
    "cispo": dict(policy="cispo", cispo_cap=1.1, kl_coef=0.05),
    "sapo": dict(policy="sapo", sapo_tau_pos=0.8, sapo_tau_neg=1.3),
    "vespo": dict(policy="vespo", vespo_k_pos=1.5, vespo_lambda_neg=2.5, aggregation="token-mean"),
    "off-policy-mask": dict(off_policy_threshold=0.0, kl_coef=0.05),
    "luspo": dict(importance_sampling="sequence", aggregation="seq-mean-token-sum", clip_eps_high=0.05),
}


def reference(model, tree, cfg: dict) -> tuple[float, list[torch.Tensor]]:
    """Per path, TRL's per-token loss for ``cfg`` (+ beta k3 KL), aggregated as ``cfg['aggregation']``."""
    policy = cfg.get("policy", "clip")
    aggregation = cfg.get("aggregation", "seq-mean-token-mean")
    tokens_total = sum(int(m.sum()) for m in tree.loss_masks)
    model.zero_grad(set_to_none=True)
    total = 0.0
    for i in range(tree.n):
        tokens, ts = tree.path_tokens(i), tree.loss_masks[i].nonzero().flatten()
        logp = torch.log_softmax(model(tokens[:-1].unsqueeze(0))[0].double(), dim=-1)[ts - 1, tokens[ts]]
        adv = tree.advantages[i].double()
        old = tree.old_logprobs[i][ts].double()
        log_ratio = logp - old
        if cfg.get("importance_sampling") == "sequence":
            log_ratio = log_ratio.mean().expand_as(logp)
        r = torch.exp(log_ratio)
        if policy == "cispo":
            token = -torch.clamp(r, max=cfg["cispo_cap"]).detach() * adv * logp
        elif policy == "sapo":
            tau = cfg["sapo_tau_pos"] if adv > 0 else cfg["sapo_tau_neg"]
            tau = float(torch.tensor(tau, dtype=torch.float32))  # TRL's torch.where makes it fp32
            token = -torch.sigmoid(tau * (r - 1)) * 4 / tau * adv
        elif policy == "vespo":
            k, lam = (cfg["vespo_k_pos"], 3.0) if adv >= 0 else (3.0, cfg["vespo_lambda_neg"])
            log_w = float(torch.clamp((logp - old).detach().clamp(-20, 20).sum(), math.log(1e-8), 20.0))
            token = -math.exp(lam + k * log_w - lam * math.exp(log_w)) * adv * logp
        else:
            eps = cfg.get("clip_eps_high", 0.2)
            token = -torch.minimum(r * adv, torch.clamp(r, 1 - 0.2, 1 + eps) * adv)
        if "off_policy_threshold" in cfg:
            drift = float((old - logp.detach()).mean())
            token = token * float(adv >= 0 or drift <= cfg["off_policy_threshold"])
        if cfg.get("kl_coef", 0.0):
            delta = tree.ref_logprobs[i][ts].double() - logp
            token = token + cfg["kl_coef"] * (torch.exp(delta) - delta - 1)
        if aggregation == "token-mean":
            path_loss = token.sum() / tokens_total
        elif aggregation == "seq-mean-token-sum":
            path_loss = token.sum() / tree.n
        else:
            path_loss = token.mean() / tree.n
        path_loss.backward()
        total += path_loss.item()
    return total, [p.grad.detach().clone() for p in model.parameters()]


def _tree(seed: int):
    tree = random_tree(seed, 3, 3, grpo=True)
    # old log-probs far from the policy (per path, drifting with position): every branch of every term is used
    tree.old_logprobs = [
        lp - 0.15 * torch.arange(lp.numel(), dtype=lp.dtype) * (1 if i % 2 else -1)
        for i, lp in enumerate(tree.old_logprobs)
    ]
    return tree


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_terms_on_trees_match_reference_and_baseline(family, name):
    model = tiny_model(family)
    tree = _tree(13)
    cfg = POLICIES[name]
    want_loss, want = reference(model, tree, cfg)
    assert any(g.abs().max() > 0 for g in want)
    for system, layout, microbatch in (
        ("baseline", "padded", None),
        ("prefixflow", "padded", None),
        ("prefixflow", "packed", 1),
        ("prefixflow", "padded", 3),
        ("baseline", "packed", 2),
    ):
        model.zero_grad(set_to_none=True)
        stats = pf.train_group(
            model, tree, system=system, layout=layout, microbatch=microbatch, loss="grpo", loss_config=cfg
        )
        got = [p.grad.detach().clone() for p in model.parameters()]
        assert abs(stats.loss - want_loss) <= TOL * max(1.0, abs(want_loss)), (system, layout, microbatch)
        assert max_rel_diff(got, want) <= TOL, (system, layout, microbatch)


def test_off_policy_mask_drops_a_path():
    """The mask is not vacuous on this tree: some negative-advantage path drifts past the threshold."""
    tree = _tree(13)
    model = tiny_model("llama3")
    cfg = POLICIES["off-policy-mask"]
    masked, _ = reference(model, tree, cfg)
    unmasked, _ = reference(model, tree, {k: v for k, v in cfg.items() if k != "off_policy_threshold"})
    assert abs(masked - unmasked) > 1e-3
