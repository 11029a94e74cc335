"""The pf-bench harness: specs -> cells -> executor -> records -> figures."""
