"""PrefixFlow: training-time KV caching for schedule-level prefix reuse in GRPO training.

>>> model = build_model("llama3:debugmodel", overrides={"dim": 64, "n_layers": 2})
>>> apply_prefixflow(model)
>>> stats = train_group(model, group)            # Phase A, B, C; gradients equal the baseline's
"""

import importlib
import importlib.abc
import importlib.util
import sys

from .group import RolloutGroup, synthetic_group
from .hooks import ScheduleHooks, add_hooks, remove_hooks
from .loss import LOSSES, LossConfig
from .memory.offload import OffloadStats, PrefixOffload
from .model.adapters import ModelAdapter, TorchTitanAdapter, adapter_for, register_adapter
from .model.apply import AC_MODES, PrefixFlowConfig, apply_ac, apply_prefixflow
from .model.compile import apply_compile
from .model.models import build_model, list_models, model_args
from .moe import MoEConfig, RoutingMasks, apply_moe, record_routing, update_expert_bias
from .runtime import PrefixFlowRuntime, runtime_of
from .schedule.driver import SYSTEMS, GroupStats, score_group, train_group
from .schedule.grad_guard import NonFiniteError
from .state.kv_cache import PrefixKVCache
from .tree.build import build_tree
from .tree.layouts import LAYOUTS
from .tree.rollout_tree import RolloutTree

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
    "PrefixFlowRuntime",
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
    "runtime_of",
    "score_group",
    "synthetic_group",
    "train_group",
    "update_expert_bias",
]

# Module paths that moved into packages (issue 31) and that the docs name: they keep importing, as the module
# they moved to (one module object under both names).
MOVED_MODULES = {
    "prefixflow.alignment": "prefixflow.checks.alignment",
    "prefixflow.live_bytes": "prefixflow.memory.live_bytes",
    "prefixflow.models": "prefixflow.model.models",
    "prefixflow.tree_layouts": "prefixflow.tree.plan",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        return importlib.import_module(MOVED_MODULES[spec.name])

    def exec_module(self, module):
        return None


if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())
