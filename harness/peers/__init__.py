"""Peer systems run on our models for side-by-side comparisons (PrefixGrouper)."""

from .prefix_grouper import train_group_prefix_grouper

__all__ = ["train_group_prefix_grouper"]
