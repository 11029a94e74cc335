"""The cost model: model shapes (``shape``, ``moe``), the FLOPs each system executes, the ideal speedup and
a FLOP counter (``flops``)."""
