"""TRL integration: :class:`PrefixFlowGRPOTrainer`, a drop-in for TRL 1.16's ``GRPOTrainer``.

- :mod:`.plan`: a TRL micro-batch as flat groups or one prefix tree, with TRL's loss for every ``loss_type``;
- :mod:`.trainer`: the trainer (``training_step`` runs PrefixFlow's phases);
- :mod:`.vision`: a VLM micro-batch's images, per completion, as each group's ``prompt_inputs``.
"""

from .plan import POLICY, SUPPORTED_LOSS_TYPES, TREE_MIN_SHARED, TrainingUnit, plan_groups
from .trainer import VERIFY_TOLERANCE, PrefixFlowGRPOTrainer

__all__ = [
    "PrefixFlowGRPOTrainer",
    "SUPPORTED_LOSS_TYPES",
    "POLICY",
    "TREE_MIN_SHARED",
    "TrainingUnit",
    "plan_groups",
    "VERIFY_TOLERANCE",
]
