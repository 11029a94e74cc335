"""How MoE routing enters the three phases: one :class:`~prefixflow.hooks.ScheduleHooks` object.

Around each microbatch (a cached node's Phase-A row and its Phase-C recomputation, a Phase-B microbatch of
leaf rows, a baseline microbatch of full sequences) the hook hands every MoE layer a :class:`RoutePlan` for
the tokens it feeds the model, in the order the layer sees them (``bs * slen``). Every call runs a tree (a
flat group is its one-cached-node tree, its routing one mask per node), and each row reads the masks of the
nodes it holds (:mod:`.tree_routing`): both systems replay the same expert ids for the same logical tokens,
and a token counts once per full sequence that feeds it (a flat group's prefix token ``N`` times), which
keeps the load counters and the auxiliary balance loss identical. Pads are routed live (their output reaches
nothing) and count 0.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..group import check_routing_masks
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

    def __init__(self, config) -> None:
        self.config = config
        self.layers: list[nn.Module] = []
        self.group_ = None
        self.phase_ = None
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
        self.routing = _routing_of(group.routing, self.layers)
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
        self.phase_ = name
        try:
            yield
        finally:
            self.phase_ = None

    @contextlib.contextmanager
    def microbatch(self, mb):
        experts, weight = tree_routing.plan(self.routing, mb, len(self.layers))
        plans = self._set(self._plans(experts, weight))
        try:
            yield
        finally:
            self._set(None)
        if self.phase_ == "A":  # a node's forward may stop after its last K/V
            self._count_skipped(plans)

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

    def _count_skipped(self, plans: list[RoutePlan]) -> None:
        """A layer a node's forward stopped before (after its last K/V) counts its replayed routing here."""
        for layer, plan in zip(self.layers, plans, strict=True):
            if plan.ran or plan.experts is None or plan.experts.numel() == 0:
                continue
            with torch.no_grad():
                weights = plan.weight.unsqueeze(-1).expand_as(plan.experts).reshape(-1)
                counts = torch.zeros_like(layer.tokens_per_expert)
                counts.index_add_(0, plan.experts.reshape(-1), weights.to(counts.dtype))
                layer.tokens_per_expert.add_(counts)

    def _aux_coefficients(self, tree) -> list[torch.Tensor]:
        """Per layer ``alpha * E * f_e / T``: ``f_e`` the fraction of the tree's routed slots on expert e, over
        the ``T`` logical tokens of its full sequences (a shared token counted once per path)."""
        router = self.layers[0].router
        return [
            self.config.aux_loss_coef * router.num_experts * fraction
            for fraction in tree_routing.fractions(tree, self.routing, router.num_experts, router.top_k)
        ]


def _moe_count(layers: list[nn.Module]) -> int:
    """MoE layers of the whole model (a pipeline stage holds some of them)."""
    return getattr(layers[0], "moe_count", len(layers))


def _routing_of(routing: list[torch.Tensor] | None, layers: list[nn.Module]) -> list[torch.Tensor] | None:
    """Each node's masks of ``layers``, by each layer's place among the whole model's MoE layers
    (``apply_moe`` numbers them before a pipeline split), so a stage replays its own layers' routing."""
    if routing is None:
        return None
    index = [getattr(layer, "moe_index", i) for i, layer in enumerate(layers)]
    if index == list(range(routing[0].shape[0])):
        return routing
    return [m[index] for m in routing]
