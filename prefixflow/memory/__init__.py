"""Memory: dormant-tensor offload and its storage tiers, microbatch budgets, live-bytes meter, limits."""
