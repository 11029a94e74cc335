"""PrefixFlow as the actor engine of a verl 0.9.x GRPO job (``pip install verl==0.9.1``; see docs/verl.md).

Importing this package registers :class:`PrefixFlowFSDPEngine` in verl's ``EngineRegistry`` for
``language_model`` / ``fsdp`` + ``fsdp2`` under the vendor key ``"prefixflow"``. A job selects it with
configuration alone: ``actor_rollout_ref.model.external_lib=prefixflow.integrations.verl`` (verl imports it in
every worker) and ``VERL_ENGINE_VENDOR=prefixflow`` in the workers' environment (verl's own engine-registry
override; engines registered for no vendor stay the fallback, e.g. the critic's). The rest of verl does not
know it is there. The loss mapping is in :mod:`.plan`, the engine in :mod:`.engine`.
"""

from __future__ import annotations

try:
    import verl  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without verl
    raise ImportError("prefixflow.integrations.verl needs verl 0.9.x: pip install verl==0.9.1") from exc

from .engine import VENDOR, PrefixFlowFSDPEngine
from .plan import AGG_MODES, KL_TYPES, GroupPlan, actor_loss_config, plan_micro_batch

__all__ = [
    "AGG_MODES",
    "KL_TYPES",
    "VENDOR",
    "GroupPlan",
    "PrefixFlowFSDPEngine",
    "actor_loss_config",
    "plan_micro_batch",
]
