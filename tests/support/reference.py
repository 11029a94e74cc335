"""An independent full-sequence computation of loss='pg' on the plain model, for exactness tests."""

from __future__ import annotations

import torch


def reference_pg(model, group) -> tuple[float, list[torch.Tensor]]:
    """-(1/N) sum_i A_i mean_t log pi(s_it | P, s_<t), one plain ``model(tokens)`` call per sequence.

    Returns the loss and every parameter's gradient (the model's grads are zeroed first and left set).
    """
    model.zero_grad(set_to_none=True)
    total = 0.0
    p = group.prompt_len
    for i, response in enumerate(group.responses):
        seq = torch.cat([group.prompt, response]).unsqueeze(0)
        logits = model(seq[:, :-1])[0, p - 1 :]
        logp = torch.log_softmax(logits.double(), dim=-1).gather(-1, response.unsqueeze(-1)).squeeze(-1)
        loss = -(group.advantages[i].double() * logp.mean()) / group.n
        loss.backward()
        total += loss.item()
    return total, [param.grad.detach().clone() for param in model.parameters()]


def max_rel_diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Max over parameters of max|got - want| / max|want| (the issue's 'relative to the largest entry')."""
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        assert g is not None, "a parameter received no gradient"
        scale = float(w.abs().max()) or 1.0
        worst = max(worst, float((g - w).abs().max()) / scale)
    return worst
