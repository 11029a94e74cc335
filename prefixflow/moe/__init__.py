"""Mixture-of-experts under PrefixFlow: Rollout Routing Replay (R3), logical token accounting, an auxiliary
balance loss, and TorchTitan's MoE layers made to run on any device.

>>> model = build_model("qwen3:debugmodel_moe")      # apply_moe is applied to every MoE flavour
>>> apply_prefixflow(model)
>>> group.routing = record_routing(model, group)   # or the rollout engine's masks
>>> train_group(model, group)                       # both systems replay the same expert ids
"""

from ..group import RoutingMasks, check_routing_masks
from .apply import MoEConfig, apply_moe, is_moe, moe_hooks_of
from .balance import tokens_per_expert, update_expert_bias
from .layers import RoutePlan
from .record import record_routing
from .schedule_hooks import MoEScheduleHooks, moe_layers

__all__ = [
    "MoEConfig",
    "MoEScheduleHooks",
    "RoutePlan",
    "RoutingMasks",
    "apply_moe",
    "check_routing_masks",
    "is_moe",
    "moe_hooks_of",
    "moe_layers",
    "record_routing",
    "tokens_per_expert",
    "update_expert_bias",
]
