"""Checks: Table-3 alignment and the injected faults of its negative controls."""
