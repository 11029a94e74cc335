"""Rollouts as prefix trees: the tree, its construction, its scoring plan and microbatch layouts."""

from .build import build_tree
from .rollout_tree import PathLosses, RolloutTree

__all__ = ["PathLosses", "RolloutTree", "build_tree"]
