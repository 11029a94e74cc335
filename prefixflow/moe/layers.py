"""TorchTitan's MoE layer, made to run everywhere and to replay recorded routing.

``apply_moe`` swaps the classes of TorchTitan 0.2.2's MoE modules in place (parameters, buffers and any
parallel plan hooks stay where they are):

- ``TokenChoiceTopKRouter`` -> :class:`ReplayRouter`: counts tokens with ``bincount`` (TorchTitan's
  ``torch.histc`` on an integer tensor has no CPU kernel), scores in ``promote_types(dtype, float32)``
  (TorchTitan rounds the scores of an fp64 model to fp32), and takes the top-k expert ids from a recorded
  mask where a :class:`RoutePlan` supplies one. The gate weights always come from the live router logits,
  so the router still trains.
- ``TokenReorderer`` -> :class:`CountingReorderer`: the same reordering, counted with ``bincount``.
- ``MoE`` -> :class:`ReplayMoE`: TorchTitan's forward (router -> reorderer -> experts -> unsort, shared
  experts), in the compute dtype, plus what the schedule needs: per-token accounting weights for the
  load-balance counters, an auxiliary balance loss term, optional capacity-limited routing (for showing why
  replay needs dropless routing), and recording of the live selection.
- ``GroupedExperts`` keeps TorchTitan's code: its grouped GEMMs (``torch._grouped_mm`` in bf16) where the
  input is a bf16 CUDA tensor, its per-expert loop everywhere else (CPU, fp32, fp64).

Without a plan set (``model(tokens)``) the layer routes live and counts every token, as TorchTitan does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

__all__ = ["RoutePlan", "ReplayRouter", "CountingReorderer", "ReplayMoE", "compute_dtype", "swap_class"]

_SWAPPED: dict[tuple[type, type], type] = {}


def swap_class(module: torch.nn.Module, mixin: type) -> None:
    """Give ``module`` the class ``(mixin, type(module))`` in place: its methods override TorchTitan's, while
    parameters, buffers, hooks and ``isinstance`` checks against TorchTitan's class stay. Idempotent."""
    base = type(module)
    if issubclass(base, mixin):
        return
    key = (mixin, base)
    if key not in _SWAPPED:
        _SWAPPED[key] = type(f"{mixin.__name__}{base.__name__}", (mixin, base), {})
    module.__class__ = _SWAPPED[key]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype routing arithmetic runs in: TorchTitan's fp32, or fp64 for an fp64 model."""
    return torch.promote_types(dtype, torch.float32)


def _in_backward() -> bool:
    """True while autograd runs a backward, i.e. while activation checkpointing recomputes a forward."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class RoutePlan:
    """What the schedule asks of one MoE layer for the next forward(s) over ``T`` token slots.

    ``experts``: LongTensor[T, k] expert ids to replay, ``-1`` = route that slot live (pads); ``None`` = all
    live. ``weight``: Tensor[T], how many logical tokens each slot stands for in the load counters and the
    auxiliary loss (0 for a pad, ``N`` for a cached prefix token); ``None`` = do not count.
    ``aux_coef``: Tensor[E], the balance loss's fixed per-expert coefficients; the layer appends
    ``sum_t weight_t * aux_coef . p(t)`` to ``aux_terms``. ``record``: when a list, the layer appends its
    selection (LongTensor[T, k]). ``ran`` is set once the layer has routed under this plan.
    """

    experts: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    aux_coef: torch.Tensor | None = None
    aux_terms: list | None = None
    record: list | None = None
    ran: bool = field(default=False, compare=False)


class ReplayRouter:
    """Mixed into TorchTitan's ``TokenChoiceTopKRouter`` (see :func:`swap_class`): routing replay."""

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None, replay=None):
        """Returns the gates [T, k], the selected expert ids [T, k], tokens per expert [E] and the scores
        over all experts [T, E] (TorchTitan returns the first three)."""
        logits = self.gate(x)
        scores = self.scores(logits)
        selected = self.select(scores, expert_bias)
        if replay is not None:
            selected = torch.where(replay >= 0, replay, selected)
        top_scores = scores.gather(dim=1, index=selected)
        if self._debug_force_load_balance:
            selected, top_scores = self._debug_force_load_balance_routing(scores)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        top_scores = top_scores * self.route_scale
        counts = torch.bincount(selected.view(-1), minlength=self.num_experts)
        return top_scores, selected, counts, scores

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Router scores over all experts, in the compute dtype (softmax or sigmoid of the logits)."""
        logits = logits.to(compute_dtype(logits.dtype))
        if self.score_func == "sigmoid":
            return torch.sigmoid(logits)
        if self.score_func == "softmax":
            return F.softmax(logits, dim=1)
        raise NotImplementedError(f"Unknown score function {self.score_func}")

    def select(self, scores: torch.Tensor, expert_bias: torch.Tensor | None) -> torch.Tensor:
        """Live top-k choice (the bias and node-limited groups only steer the choice, not the gates)."""
        with torch.no_grad():
            choice = scores if expert_bias is None else scores + expert_bias
            if self.num_expert_groups is not None:
                choice = self._get_node_limited_routing_scores(choice)
            return torch.topk(choice, k=self.top_k, dim=-1, sorted=False).indices


class CountingReorderer:
    """Mixed into TorchTitan's ``TokenReorderer``: the same reordering, counted with ``bincount``."""

    def forward(self, top_scores: torch.Tensor, selected_experts_indices: torch.Tensor):
        flat = selected_experts_indices.view(-1)
        counts = torch.bincount(flat, minlength=self.num_experts)
        order = torch.argsort(flat, stable=True)
        return top_scores.view(-1)[order], order, counts


def _capacity_keep(selected: torch.Tensor, num_experts: int, capacity_factor: float) -> torch.Tensor:
    """Token dropping: each expert keeps its first ``ceil(cf * T * k / E)`` assignments in token order."""
    flat = selected.view(-1)
    capacity = math.ceil(capacity_factor * flat.numel() / num_experts)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    starts = counts.cumsum(0) - counts
    rank = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    keep = torch.empty_like(flat, dtype=torch.bool)
    keep[order] = rank < capacity
    return keep.view_as(selected)


def balance_probs(router: ReplayRouter, scores: torch.Tensor) -> torch.Tensor:
    """Per-token router probabilities the balance loss averages (sigmoid scores are normalised)."""
    if router.score_func == "sigmoid":
        return scores / scores.sum(dim=-1, keepdim=True)
    return scores


class ReplayMoE:
    """Mixed into TorchTitan's ``MoE``. ``route_plan``: set by the schedule hooks, else None.
    ``capacity_factor``: None = dropless (TorchTitan's behaviour)."""

    route_plan: RoutePlan | None = None
    capacity_factor: float | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        plan = self.route_plan
        replay = None if plan is None else plan.experts
        if replay is not None and replay.shape[0] != x.shape[0]:
            raise RuntimeError(f"route plan covers {replay.shape[0]} tokens, the layer got {x.shape[0]}")
        top_scores, selected, counts, scores = self.router(x, self.expert_bias, replay)
        self._account(plan, selected, counts)
        if plan is not None and plan.aux_coef is not None:
            term = self._aux_term(scores, plan)
            if not _in_backward():  # a recomputation's term is a duplicate: only its graph is needed
                plan.aux_terms.append(term)
        if self.capacity_factor is not None:
            keep = _capacity_keep(selected, self.router.num_experts, self.capacity_factor)
            top_scores = top_scores * keep

        top_sorted, token_order, counts = self.reorderer(top_scores, selected)
        routed_input = x[token_order // self.router.top_k]
        compute = compute_dtype(x.dtype)
        if self.score_before_experts:
            routed_input = (routed_input.to(compute) * top_sorted.reshape(-1, 1)).to(x.dtype)
        self.experts.use_grouped_mm = routed_input.is_cuda and routed_input.dtype == torch.bfloat16
        routed_output = self.experts(routed_input, counts)
        out = self.shared_experts(x) if self.shared_experts is not None else None

        unsorted = torch.zeros(
            (bs * slen * self.router.top_k, dim), dtype=routed_output.dtype, device=routed_output.device
        )
        unsorted[token_order] = routed_output
        unsorted = unsorted.reshape(-1, self.router.top_k, dim)
        if not self.score_before_experts:
            weights = top_scores.reshape(-1, 1, self.router.top_k).to(compute)
            out_experts = torch.bmm(weights, unsorted.to(compute)).to(x.dtype).squeeze(1)
        else:
            out_experts = unsorted.sum(dim=1)
        if out is None:
            return out_experts.reshape(bs, slen, dim)
        return (out + out_experts).reshape(bs, slen, dim)

    def _account(self, plan: RoutePlan | None, selected: torch.Tensor, counts: torch.Tensor) -> None:
        """Load counters for the aux-loss-free bias update: each routed slot counts ``weight`` times."""
        if plan is not None:
            plan.ran = True
            if plan.record is not None:
                plan.record.append(selected.detach().clone())
        if _in_backward():
            return  # recomputation under activation checkpointing: this forward was counted already
        with torch.no_grad():
            if plan is None:
                self.tokens_per_expert.add_(counts.to(self.tokens_per_expert.dtype))
            elif plan.weight is not None:
                weighted = torch.zeros_like(self.tokens_per_expert)
                per_slot = plan.weight.to(weighted.dtype).unsqueeze(1).expand_as(selected)
                weighted.index_add_(0, selected.reshape(-1), per_slot.reshape(-1))
                self.tokens_per_expert.add_(weighted)

    def _aux_term(self, scores: torch.Tensor, plan: RoutePlan) -> torch.Tensor:
        """``sum_t weight_t * sum_e aux_coef_e * p_e(t)``: this forward's share of the balance loss."""
        probs = balance_probs(self.router, scores)
        weight = plan.weight.to(probs.dtype)
        return (weight.unsqueeze(1) * probs * plan.aux_coef.to(probs.dtype)).sum()
