"""The stage program of pipeline parallelism: the ordered operations of one stage for one rollout group.

One definition of both phase switchings (``stage_local`` and ``barrier``, see :mod:`prefixflow.parallel.pp`):
the stage runtime (:mod:`prefixflow.parallel.pp_stage`) executes it and the simulator in ``harness/`` replays it.
"""

from __future__ import annotations

__all__ = ["SWITCHING", "stage_program"]

SWITCHING = ("stage_local", "barrier")


def stage_program(
    switching: str, n_stages: int, stage: int, n_microbatches: int, prefix: bool
) -> list[tuple]:
    """The ordered operations of one stage: ``("A",)``, ``("F", m)``, ``("B", m)``, ``("C",)``, ``("barrier",)``."""
    if switching not in SWITCHING:
        raise ValueError(f"switching {switching!r} unknown; valid: {SWITCHING}")
    ops: list[tuple] = []
    if prefix:
        ops.append(("A",))
        if switching == "barrier":
            ops.append(("barrier",))
    warmup = min(n_stages - stage - 1, n_microbatches)
    ops += [("F", m) for m in range(warmup)]
    for m in range(warmup, n_microbatches):
        ops += [("F", m), ("B", m - warmup)]
    ops += [("B", m) for m in range(n_microbatches - warmup, n_microbatches)]
    if prefix:
        if switching == "barrier":
            ops.append(("barrier",))
        ops.append(("C",))
    return ops
