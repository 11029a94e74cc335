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
- ``GroupedExperts`` -> :class:`PortableExperts`: TorchTitan's grouped GEMMs (``torch._grouped_mm`` in bf16)
  where the input is a bf16 CUDA tensor; elsewhere (CPU, fp32, fp64) a loop over the experts in the input's
  dtype. TorchTitan's own loop indexes ``w[e]`` per expert, whose backward materialises a zero gradient of
  the whole ``[E, ...]`` weight for every expert (64 full-size fills per weight and layer on
  debugmodel_moe, 90% of a CPU step); the loop here unbinds each weight once.

Without a plan set (``model(tokens)``) the layer routes live and counts every token, as TorchTitan does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

__all__ = [
    "RoutePlan",
    "ReplayRouter",
    "CountingReorderer",
    "PortableExperts",
    "ReplayMoE",
    "compute_dtype",
    "swap_class",
]

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
    """What the schedule asks of one MoE layer for the next forward(s) over a ``[b, L]`` token layout.

    ``shape``: ``(b, L)``, the tokens the schedule feeds (None: whatever comes, nothing replayed or counted).
    ``experts``: LongTensor[b, L, k] expert ids to replay, ``-1`` = route that slot live (pads); ``None`` =
    all live. ``weight``: Tensor[b, L], how many logical tokens each slot stands for in the load counters
    and the auxiliary loss (0 for a pad, ``N`` for a cached prefix token); ``None`` = do not count.
    ``aux_coef``: Tensor[E], the balance loss's fixed per-expert coefficients; the layer appends
    ``sum_t weight_t * aux_coef . p(t)`` to ``aux_terms``. ``record``: when a list, the layer appends its
    selection (LongTensor[b * L, k]). ``ran`` is set once the layer has routed under this plan.

    A parallel plan may pad each row at its end before the layer sees it (TP pads to a multiple of its
    degree): those slots route live and count 0.
    """

    shape: tuple[int, int] | None = None
    experts: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    aux_coef: torch.Tensor | None = None
    aux_terms: list | None = None
    record: list | None = None
    ran: bool = field(default=False, compare=False)

    def fit(self, bs: int, slen: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``experts`` [bs * slen, k] and ``weight`` [bs * slen] for the layer's input, pads appended."""
        if self.shape is None:
            return None, None
        b, length = self.shape
        if bs != b or slen < length:
            raise RuntimeError(f"route plan for {b}x{length} tokens, the MoE layer got {bs}x{slen}")
        pad = slen - length
        experts, weight = self.experts, self.weight
        if experts is not None:
            experts = F.pad(experts, (0, 0, 0, pad), value=-1).reshape(bs * slen, -1)
        if weight is not None:
            weight = F.pad(weight, (0, pad)).reshape(bs * slen)
        return experts, weight

    def keep(self, selected: torch.Tensor, bs: int, slen: int) -> torch.Tensor:
        """The selection of the plan's own tokens (pads dropped): LongTensor[b * L, k]."""
        if self.shape is None:
            return selected
        b, length = self.shape
        return selected.view(bs, slen, -1)[:, :length].reshape(b * length, -1)


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


class PortableExperts:
    """Mixed into TorchTitan's ``GroupedExperts``: its grouped GEMMs on bf16 CUDA input, else a loop over
    the experts that unbinds each weight once (one gradient buffer per weight, not one per expert)."""

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if self.use_grouped_mm:
            return super().forward(x, num_tokens_per_expert)
        weights = [w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w2, self.w3)]
        counts = num_tokens_per_expert.tolist()
        used = sum(counts)
        outs = []
        for x_e, w1, w2, w3 in zip(
            torch.split(x[:used], counts), *(w.unbind(0) for w in weights), strict=True
        ):
            h = F.silu(torch.matmul(x_e, w1.transpose(-2, -1))) * torch.matmul(x_e, w3.transpose(-2, -1))
            outs.append(torch.matmul(h, w2.transpose(-2, -1)))
        out = torch.cat(outs)
        if used < x.shape[0]:  # rows TorchTitan's EP padding appended (CUDA, not bf16): no expert's tokens
            out = torch.cat([out, out.new_zeros(x.shape[0] - used, out.shape[-1])])
        return out


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


def _partial_grad(t: torch.Tensor, mesh) -> torch.Tensor:
    """Identity forward; backward sums the gradient over ``mesh`` (a replicated value whose consumers
    on each rank see only that rank's partial share of the output)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    return DTensor.from_local(t, mesh, (Replicate(),), run_check=False).to_local(grad_placements=(Partial(),))


class ReplayMoE:
    """Mixed into TorchTitan's ``MoE``. ``route_plan``: set by the schedule hooks, else None.
    ``capacity_factor``: None = dropless (TorchTitan's behaviour).

    Under tensor parallelism (``tp_mesh`` set by ``prefixflow.parallel.ep``) the layer's output is a
    partial sum over the TP ranks, while the router runs replicated. Gradients reaching replicated values
    from per-rank partial outputs are summed over the ranks: the gates when they weight the expert outputs
    (Qwen3's ``score_before_experts=False``) or when each rank routes its share of the tokens
    (``tokens_split_over_tp``: EP borrowing the TP ranks), and then also the tokens sent to the experts.
    TorchTitan's ``TensorParallel`` plan already does it for the experts' input.
    """

    route_plan: RoutePlan | None = None
    capacity_factor: float | None = None
    tp_mesh = None
    tokens_split_over_tp: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        plan = self.route_plan
        replay, weight = (None, None) if plan is None else plan.fit(bs, slen)
        top_scores, selected, counts, scores = self.router(x, self.expert_bias, replay)
        self._account(plan, weight, selected, counts, bs, slen)
        if plan is not None and plan.aux_coef is not None:
            term = self._aux_term(scores, weight, plan.aux_coef)
            if not _in_backward():  # a recomputation's term is a duplicate: only its graph is needed
                plan.aux_terms.append(term)
        if self.capacity_factor is not None:
            keep = _capacity_keep(selected, self.router.num_experts, self.capacity_factor)
            top_scores = top_scores * keep

        source = x
        if self.tp_mesh is not None and (self.tokens_split_over_tp or not self.score_before_experts):
            top_scores = _partial_grad(top_scores, self.tp_mesh)
        if self.tp_mesh is not None and self.tokens_split_over_tp:
            source = _partial_grad(x, self.tp_mesh)
        top_sorted, token_order, counts = self.reorderer(top_scores, selected)
        routed_input = source[token_order // self.router.top_k]
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

    def _account(self, plan, weight, selected, counts, bs: int, slen: int) -> None:
        """Load counters for the aux-loss-free bias update: each routed slot counts ``weight`` times."""
        if plan is not None:
            plan.ran = True
            if plan.record is not None:
                plan.record.append(plan.keep(selected, bs, slen).detach().clone())
        if _in_backward():
            return  # recomputation under activation checkpointing: this forward was counted already
        with torch.no_grad():
            if plan is None:
                self.tokens_per_expert.add_(counts.to(self.tokens_per_expert.dtype))
            elif weight is not None:
                weighted = torch.zeros_like(self.tokens_per_expert)
                per_slot = weight.to(weighted.dtype).unsqueeze(1).expand_as(selected)
                weighted.index_add_(0, selected.reshape(-1), per_slot.reshape(-1))
                self.tokens_per_expert.add_(weighted)

    def _aux_term(self, scores: torch.Tensor, weight: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        """``sum_t weight_t * sum_e aux_coef_e * p_e(t)``: this forward's share of the balance loss."""
        probs = balance_probs(self.router, scores)
        return (weight.to(probs.dtype).unsqueeze(1) * probs * coef.to(probs.dtype)).sum()
