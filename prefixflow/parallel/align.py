"""Table 3 under a parallel layout: baseline and PrefixFlow copies, both parallelized the same way.

Same protocol as :func:`prefixflow.checks.alignment.run_alignment` (same seeds, groups, AdamW settings, tolerances
and rows), with each copy built on every rank, wrapped by ``apply_prefixflow`` and ``parallelize``-d over
the same mesh, and each step trained by :func:`prefixflow.parallel.dp.train_step` over ``groups_per_step``
groups (default: one per data-parallel rank). Gradients and weights are gathered to full tensors before
they are compared, so every rank returns the same rows. Run it on every rank of the process group.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..checks.alignment import CORRECT, AlignmentRow, GroupDraw, alignment_rows
from ..model.apply import apply_prefixflow
from ..model.models import build_model, model_args
from . import ParallelDims, build_mesh, parallelize
from .dp import train_step

__all__ = ["run_parallel_alignment"]

_MIXED = (torch.bfloat16, torch.float16)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run_parallel_alignment(
    model: str = "llama3:debugmodel",
    *,
    dims: ParallelDims | dict,
    overrides: dict | None = None,
    dtype: torch.dtype = torch.bfloat16,
    steps: int = 20,
    report_steps: Iterable[int] = (1, 10, 20),
    prefix_len: int = 96,
    suffix_len: int = 32,
    n: int = 4,
    layout: str = "padded",
    microbatch: int | None = None,
    loss: str = "pg",
    loss_config: dict | None = None,
    ac: str = "none",
    lr: float = 1e-5,
    seed: int = 0,
    groups_per_step: int | None = None,
    split_threshold: float | None = 0.25,
) -> list[AlignmentRow]:
    """G/L/W rows of PrefixFlow vs the baseline, both under ``dims`` (see the module doc): the one alignment
    loop (:func:`~prefixflow.checks.alignment.alignment_rows`) with parallelized copies, ``train_step`` and
    gathered tensors. Group ``g`` of step ``s`` is drawn as ``run_alignment`` draws step ``s``'s group when
    ``g`` is 0."""
    dims = ParallelDims.of(dims)
    report = set(report_steps)
    if steps < 1 or not report or min(report) < 1 or max(report) > steps:
        raise ValueError(f"report_steps {sorted(report)} must lie in [1, steps={steps}]")
    k = groups_per_step or dims.batch
    if k < 1:
        raise ValueError(f"groups_per_step must be >= 1, got {k}")
    autocast = dtype in _MIXED
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    mesh = build_mesh(dims, device)
    copies = {}
    for run in ("baseline", CORRECT):
        m = build_model(
            model, dtype=torch.float32 if autocast else dtype, seed=seed, overrides=overrides, device=device
        )
        copies[run] = parallelize(apply_prefixflow(m), dims, ac=ac, mesh=mesh)  # with pp > 1: this stage
    draw = GroupDraw(
        model_args(copies["baseline"]).vocab_size, prefix_len, suffix_len, n, seed, loss == "grpo"
    )

    def train(m, groups: list, system: str):
        return train_step(
            m, groups, system=system, layout=layout, microbatch=microbatch, loss=loss,
            loss_config=loss_config, split_threshold=split_threshold,
        )  # fmt: skip

    rows = alignment_rows(
        copies, lambda step: draw(step, k), train, steps=steps, report=report, dtype=dtype, lr=lr, full=_full
    )
    return _merge_stages(rows) if dims.pp > 1 else rows


def _merge_stages(rows: list[AlignmentRow]) -> list[AlignmentRow]:
    """Every pipeline stage compared its own parameters: one row per (step, quantity) over all stages (the
    largest differences, the worst tensor's name, and a pass only if every stage passed)."""
    import torch.distributed as dist

    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, [r.as_dict() for r in rows])
    merged = []
    for i, row in enumerate(rows):
        parts = [AlignmentRow(**ranks[i]) for ranks in every]
        worst = max(parts, key=lambda r: r.norm_rel_diff if r.norm_rel_diff == r.norm_rel_diff else -1.0)
        row.max_abs_diff = max(r.max_abs_diff for r in parts)
        row.max_abs_value = max(r.max_abs_value for r in parts)
        row.passed = all(r.passed for r in parts)
        row.paper_pass = all(r.paper_pass for r in parts)
        row.norm_rel_diff, row.worst_tensor = worst.norm_rel_diff, worst.worst_tensor
        merged.append(row)
    return merged
