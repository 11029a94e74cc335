"""How the schedule reaches a model: the TorchTitan registry, model adapters, apply_prefixflow, compile, dtypes."""
