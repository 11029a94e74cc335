"""PrefixFlow: training-time KV caching for schedule-level prefix reuse in GRPO training.

>>> model = build_model("llama3:debugmodel", overrides={"dim": 64, "n_layers": 2})
>>> apply_prefixflow(model)
>>> stats = train_group(model, group)            # Phase A, B, C; gradients equal the baseline's
"""

from .adapters import ModelAdapter, TorchTitanAdapter, adapter_for, register_adapter
from .apply import AC_MODES, PrefixFlowConfig, apply_ac, apply_prefixflow
from .compile import apply_compile
from .grad_guard import NonFiniteError
from .group import RolloutGroup, synthetic_group
from .hooks import ScheduleHooks, add_hooks, remove_hooks
from .kv_cache import PrefixKVCache
from .layouts import LAYOUTS
from .loss import LOSSES, LossConfig
from .models import build_model, list_models, model_args
from .moe import MoEConfig, RoutingMasks, apply_moe, record_routing, update_expert_bias
from .offload import OffloadStats, PrefixOffload
from .schedule import SYSTEMS, GroupStats, train_group
from .tree import RolloutTree
from .tree_build import build_tree

__all__ = [
    "AC_MODES",
    "LAYOUTS",
    "LOSSES",
    "SYSTEMS",
    "GroupStats",
    "LossConfig",
    "ModelAdapter",
    "MoEConfig",
    "NonFiniteError",
    "OffloadStats",
    "PrefixFlowConfig",
    "PrefixKVCache",
    "PrefixOffload",
    "RolloutGroup",
    "RolloutTree",
    "TorchTitanAdapter",
    "adapter_for",
    "RoutingMasks",
    "ScheduleHooks",
    "apply_ac",
    "apply_compile",
    "apply_moe",
    "add_hooks",
    "apply_prefixflow",
    "build_model",
    "build_tree",
    "list_models",
    "model_args",
    "register_adapter",
    "record_routing",
    "remove_hooks",
    "synthetic_group",
    "train_group",
    "update_expert_bias",
]
