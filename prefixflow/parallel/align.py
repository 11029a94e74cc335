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

from ..checks.alignment import CORRECT, AlignmentRow, _step_rows, tolerances
from ..group import synthetic_group
from ..model.apply import apply_prefixflow
from ..model.dtypes import dtype_name
from ..model.models import build_model, model_args
from . import ParallelDims, build_mesh, parallelize
from .dp import train_step

__all__ = ["run_parallel_alignment"]

_MIXED = (torch.bfloat16, torch.float16)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class _Gathered:
    """What ``alignment._step_rows`` reads of a model (``parameters()``), as full tensors."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors

    def parameters(self):
        return iter(self.tensors)


def _name(n: str) -> str:
    return n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


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
    """G/L/W rows of PrefixFlow vs the baseline, both under ``dims`` (see the module doc). Group ``g`` of
    step ``s`` is drawn as ``run_alignment`` draws step ``s``'s group when ``g`` is 0."""
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
        m = parallelize(apply_prefixflow(m), dims, ac=ac, mesh=mesh)  # with pp > 1: this rank's stage
        start = [_full(p.detach()).clone() for p in m.parameters()]
        copies[run] = (m, torch.optim.AdamW(m.parameters(), lr=lr), start)
    names = [_name(n) for n, _ in copies["baseline"][0].named_parameters()]
    vocab = model_args(copies["baseline"][0]).vocab_size
    gen = torch.Generator().manual_seed(seed)
    rows: list[AlignmentRow] = []
    for step in range(1, steps + 1):
        groups = []
        for g in range(k):
            lens = torch.randint(max(1, suffix_len // 2), suffix_len + 1, (n,), generator=gen).tolist()
            groups.append(
                synthetic_group(
                    vocab,
                    prefix_len,
                    lens,
                    seed=seed * 100_003 + step + 1_000_003 * g,
                    with_logprobs=loss == "grpo",
                )
            )
        tau = tolerances(dtype, sum(prefix_len + s - 1 for gr in groups for s in gr.response_lens))
        state = {}
        for run, (m, opt, start) in copies.items():
            opt.zero_grad(set_to_none=True)
            device_type = next(m.parameters()).device.type
            with torch.autocast(device_type, dtype=dtype, enabled=autocast):
                stats = train_step(
                    m,
                    groups,
                    system="baseline" if run == "baseline" else "prefixflow",
                    layout=layout,
                    microbatch=microbatch,
                    loss=loss,
                    loss_config=loss_config,
                    split_threshold=split_threshold,
                )
            grads = None
            if step in report:
                grads = [_full(p.grad).detach().clone() for p in m.parameters()]
            opt.step()
            weights = _Gathered([_full(p.detach()) for p in m.parameters()]) if step in report else None
            state[run] = (grads, torch.tensor(stats.loss, dtype=torch.float64), weights, start)
        if step in report:
            rows += _step_rows(step, state, names, tau, dtype_name(dtype))
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
