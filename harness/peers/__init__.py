"""Peer implementations run on our models for side-by-side comparisons (``prefix_grouper``: PrefixGrouper;
``timing``: its timing harness; ``tree_mask``, ``dfs_relay``, ``tree_flat``: the prefix-tree peers, with
``tree_common``; ``node_cost``: the measurement behind ``build_tree(min_shared_tokens="auto")``)."""
