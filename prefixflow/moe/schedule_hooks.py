"""How MoE routing enters the three phases: one :class:`~prefixflow.hooks.ScheduleHooks` object.

Around each unit of work the hook hands every MoE layer a :class:`RoutePlan` for the tokens that unit feeds
the model, in the order the layer sees them (``bs * slen``):

==========================  ============================================  ================
unit                        tokens                                         accounting weight
==========================  ============================================  ================
Phase A, Phase C (recompute) ``P[:-1]``: the prefix mask's first ``P-1`` rows  ``N`` each
Phase B microbatch           per suffix ``[P[-1], S_i[:-1]]``: the prefix mask's last row + its suffix mask  1 (pads 0)
baseline microbatch          per sequence ``[P, S_i[:-1]]``: prefix mask + its suffix mask  1 (pads 0)
==========================  ============================================  ================

So both systems replay the same expert ids for the same logical tokens, and count every prefix token ``N``
times (logical prefix-token accounting), which keeps the load counters and the auxiliary balance loss
identical. Pads are routed live (their output reaches nothing) and count 0.

A prefix tree (``RolloutTree.routing``: one mask per node) replays per row (:mod:`.tree_routing`): each row
reads the masks of the nodes it holds, and a token counts once per full sequence (path) that feeds it.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..group import RoutingMasks, check_routing_masks
from ..hooks import ScheduleHooks
from ..tree.rollout_tree import RolloutTree
from . import tree_routing
from .layers import ReplayMoE, RoutePlan

__all__ = ["MoEScheduleHooks", "moe_layers"]


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE layers (after ``apply_moe``), in ``model.layers`` order."""
    return [m for m in model.modules() if isinstance(m, ReplayMoE)]


class MoEScheduleHooks(ScheduleHooks):
    """Routing replay, logical token accounting and the auxiliary balance loss for both systems.
    Registered by :func:`prefixflow.moe.apply_moe`; reads its ``config`` (a :class:`MoEConfig`)."""

    runs_trees = True

    def __init__(self, config) -> None:
        self.config = config
        self.layers: list[nn.Module] = []
        self.group_ = None
        self.routing = None  # the group's routing masks of this model's MoE layers (a pipeline stage's own)
        self.system = None
        self.aux_coef: list[torch.Tensor] | None = None
        self.aux_terms: list[torch.Tensor] = []
        self.aux_loss = 0.0  # the last group's auxiliary loss (both systems report the same value)

    # -- validation ---------------------------------------------------------------------------------------
    def check(self, model, group, system) -> None:
        layers = moe_layers(model)
        routing = group.routing
        if routing is not None:
            router = layers[0].router
            if isinstance(group, RolloutTree):
                tree_routing.check(group, _moe_count(layers), router.num_experts, router.top_k)
            else:
                check_routing_masks(routing, group.prompt_len, group.response_lens)  # also if set later
                routing.check_model(_moe_count(layers), router.num_experts, router.top_k)
            if self.config.capacity_factor is not None:
                raise ValueError(
                    f"MoEConfig.capacity_factor={self.config.capacity_factor} drops tokens depending on the "
                    "batch, so replayed routing is not the rollout's; routing replay needs dropless MoE "
                    "(capacity_factor=None)"
                )
        elif self.config.aux_loss_coef:
            raise ValueError(
                "MoEConfig.aux_loss_coef needs group.routing: the balance statistics must be known for the "
                "whole group before its first backward; record them with prefixflow.record_routing(model, "
                "group) (or from the rollout engine)"
            )

    # -- contexts -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def group(self, model, group, system):
        self.layers, self.group_, self.system = moe_layers(model), group, system
        tree = isinstance(group, RolloutTree)
        self.routing = group.routing if tree else _routing_of(group.routing, self.layers)
        self.aux_coef = self._aux_coefficients(group) if self.config.aux_loss_coef else None
        self.aux_terms, self.aux_loss = [], 0.0
        try:
            yield
        finally:
            self._set(None)
            self.layers, self.group_, self.aux_coef, self.aux_terms = [], None, None, []
            self.routing = None

    @contextlib.contextmanager
    def phase(self, name):
        if name not in ("A", "C") or isinstance(self.group_, RolloutTree):  # a tree plans per row
            yield
            return
        plans = self._set(self._prefix_plan())
        try:
            yield
        finally:
            self._set(None)
        if name == "A":
            self._count_skipped(plans)

    @contextlib.contextmanager
    def microbatch(self, mb):
        if mb.tree_rows is not None:
            experts, weight = tree_routing.plan(self.routing, mb, len(self.layers))
            plans = self._plans(experts, weight)
        else:
            plans = self._microbatch_plan(mb)
        self._set(plans)
        try:
            yield
        finally:
            self._set(None)

    def full_prefix_forward(self) -> bool:
        """Phase A may not stop at the last K/V when the last MoE layer's prefix routing is needed: for the
        balance loss, or for the live load counters."""
        if self.group_ is None:
            return False
        live_counting = self.routing is None and self.layers[-1].load_balance_coeff is not None
        return bool(self.config.aux_loss_coef) or live_counting

    def extra_loss(self) -> torch.Tensor | None:
        if not self.aux_terms:
            return None
        total = torch.stack(self.aux_terms).sum()
        self.aux_terms = []
        self.aux_loss += float(total.detach())
        return total

    # -- plans --------------------------------------------------------------------------------------------
    def _set(self, plans: list[RoutePlan] | None) -> list[RoutePlan] | None:
        for i, layer in enumerate(self.layers):
            layer.route_plan = None if plans is None else plans[i]
        return plans

    def _plans(self, experts, weight: torch.Tensor) -> list[RoutePlan]:
        """One plan per layer over ``weight``'s ``[b, L]`` tokens; ``experts``: [n_layers, b, L, k] or None."""
        return [
            RoutePlan(
                shape=tuple(weight.shape),
                experts=None if experts is None else experts[i],
                weight=weight,
                aux_coef=None if self.aux_coef is None else self.aux_coef[i],
                aux_terms=self.aux_terms,
            )
            for i in range(len(self.layers))
        ]

    def _prefix_plan(self) -> list[RoutePlan]:
        group = self.group_
        experts = None if self.routing is None else self.routing.prefix[:, None, :-1]
        weight = torch.full((1, group.prompt_len - 1), float(group.n), device=group.prompt.device)
        return self._plans(experts, weight)

    def _sequence_masks(self, response: int, full: bool) -> torch.Tensor | None:
        routing = self.routing
        if routing is None:
            return None
        prefix = routing.prefix if full else routing.prefix[:, -1:]
        return torch.cat([prefix, routing.suffixes[response]], dim=1)

    def _microbatch_plan(self, mb) -> list[RoutePlan]:
        group, full = self.group_, mb.cached_prefix_len is None
        lens = [(group.prompt_len if full else 1) + group.response_lens[r] - 1 for r in mb.responses]
        rows, width = mb.tokens.shape
        slots = [(j * width if rows == len(lens) else sum(lens[:j]), n) for j, n in enumerate(lens)]
        weight = torch.zeros(mb.tokens.numel(), device=mb.tokens.device)
        experts = None
        if self.routing is not None:
            k = self.routing.top_k
            experts = torch.full((len(self.layers), mb.tokens.numel(), k), -1, device=mb.tokens.device)
        for (start, n), r in zip(slots, mb.responses, strict=True):
            weight[start : start + n] = 1.0
            if experts is not None:
                experts[:, start : start + n] = self._sequence_masks(r, full)
        if experts is not None:
            experts = experts.view(len(self.layers), rows, width, -1)
        return self._plans(experts, weight.view(rows, width))

    def _count_skipped(self, plans: list[RoutePlan]) -> None:
        """A layer Phase A stopped before (after the last K/V) counts its replayed prefix routing here."""
        for layer, plan in zip(self.layers, plans, strict=True):
            if plan.ran or plan.experts is None or plan.experts.numel() == 0:
                continue
            with torch.no_grad():
                weights = plan.weight.unsqueeze(-1).expand_as(plan.experts).reshape(-1)
                counts = torch.zeros_like(layer.tokens_per_expert)
                counts.index_add_(0, plan.experts.reshape(-1), weights.to(counts.dtype))
                layer.tokens_per_expert.add_(counts)

    def _aux_coefficients(self, group) -> list[torch.Tensor]:
        """Per layer ``alpha * E * f_e / T``: ``f_e`` the fraction of the group's routed slots on expert e, over
        the ``T`` logical tokens of the N full sequences (the prefix counted N times)."""
        routing, router = self.routing, self.layers[0].router
        num_experts, k = router.num_experts, router.top_k
        if isinstance(group, RolloutTree):
            return [
                self.config.aux_loss_coef * num_experts * fraction
                for fraction in tree_routing.fractions(group, routing, num_experts, k)
            ]
        tokens = group.n * group.prompt_len + sum(n - 1 for n in group.response_lens)
        coefs = []
        for layer in range(routing.n_layers):
            counts = group.n * torch.bincount(routing.prefix[layer].reshape(-1), minlength=num_experts)
            for suffix in routing.suffixes:
                counts = counts + torch.bincount(suffix[layer].reshape(-1), minlength=num_experts)
            fraction = counts.double() / (tokens * k)
            coefs.append(self.config.aux_loss_coef * num_experts * fraction / tokens)
        return coefs


def _moe_count(layers: list[nn.Module]) -> int:
    """MoE layers of the whole model (a pipeline stage holds some of them)."""
    return getattr(layers[0], "moe_count", len(layers))


def _routing_of(routing: RoutingMasks | None, layers: list[nn.Module]) -> RoutingMasks | None:
    """The masks of ``layers``, by each layer's place among the whole model's MoE layers (``apply_moe``
    numbers them before a pipeline split), so a stage replays its own layers' routing."""
    if routing is None:
        return None
    index = [getattr(layer, "moe_index", i) for i, layer in enumerate(layers)]
    if index == list(range(routing.n_layers)):
        return routing
    return RoutingMasks(routing.prefix[index], [s[index] for s in routing.suffixes])
