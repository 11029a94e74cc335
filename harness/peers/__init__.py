"""Peer implementations run on our models for side-by-side comparisons (``prefix_grouper``: PrefixGrouper;
``timing``: its timing harness)."""
