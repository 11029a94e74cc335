"""Estimates: a cell's exact per-phase peak live bytes and counted FLOPs without running it for real.

The cell's own code (its contenders' ``step``, i.e. ``prefixflow.train_group``) runs under
``torch._subclasses.fake_tensor.FakeTensorMode``: every tensor the step makes has its true size and lifetime
and every op its true FLOPs, and nothing is allocated. ``pf-bench run --estimate``, ``pf-bench sweep
--estimate`` and a spec's ``executor: {kind: estimate}`` come here (see docs/estimate.md). The normal path
never imports this package.
"""

from harness.estimate.cell import estimate_cell, unsupported

__all__ = ["estimate_cell", "unsupported"]
