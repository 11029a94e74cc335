"""The schedule: one driver and one set of phase functions for every shape."""
