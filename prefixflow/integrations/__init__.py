"""Integrations with other training stacks. The core (``prefixflow/`` outside this package) never imports them.

- :mod:`prefixflow.integrations.hf`: Hugging Face transformers causal LMs (``pip install prefixflow[hf]``).
- :mod:`prefixflow.integrations.trl`: ``PrefixFlowGRPOTrainer``, a drop-in for TRL's ``GRPOTrainer``.
"""
