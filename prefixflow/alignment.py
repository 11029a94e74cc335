"""Multi-step alignment (paper Table 3): baseline and PrefixFlow copies trained side by side.

Both copies start from the same seed, see the same groups and take AdamW steps with the same settings. At
the chosen steps we compare gradients before the step (G), the loss (L) and the weights after the step (W)
with the paper's elementwise pass rule ``|x - y| <= tau_abs + tau_rel * max(|x|, |y|)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch

from .apply import apply_ac, apply_prefixflow
from .group import synthetic_group
from .models import build_model, model_args
from .schedule import train_group

__all__ = ["AlignmentRow", "run_alignment", "passes", "format_alignment"]

TAU_ABS = 1e-3
TAU_REL = 1e-2


@dataclass
class AlignmentRow:
    step: int
    quantity: str  # "G" gradients, "L" loss, "W" after-update weights
    max_abs_diff: float
    max_abs_value: float
    passed: bool

    def as_dict(self) -> dict:
        return asdict(self)


def passes(x: torch.Tensor, y: torch.Tensor, tau_abs: float = TAU_ABS, tau_rel: float = TAU_REL) -> bool:
    """The paper's elementwise rule, on every matched element."""
    x, y = x.double(), y.double()
    return bool(((x - y).abs() <= tau_abs + tau_rel * torch.maximum(x.abs(), y.abs())).all())


def _compare(step: int, quantity: str, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> AlignmentRow:
    diff = max(float((x.double() - y.double()).abs().max()) for x, y in zip(xs, ys, strict=True))
    top = max(
        float(torch.maximum(x.double().abs(), y.double().abs()).max()) for x, y in zip(xs, ys, strict=True)
    )
    ok = all(passes(x, y) for x, y in zip(xs, ys, strict=True))
    return AlignmentRow(step, quantity, diff, top, ok)


def run_alignment(
    model: str = "llama3:debugmodel",
    *,
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
) -> list[AlignmentRow]:
    """Train baseline and PrefixFlow copies for ``steps`` AdamW steps on the same synthetic groups (response
    lengths vary in ``[suffix_len // 2, suffix_len]``); return G/L/W rows at ``report_steps``."""
    report = set(report_steps)
    if steps < 1 or not report or min(report) < 1 or max(report) > steps:
        raise ValueError(f"report_steps {sorted(report)} must lie in [1, steps={steps}]")
    # bf16/fp16 run as mixed precision: fp32 master weights and optimizer, forward/backward under autocast.
    autocast = dtype in (torch.bfloat16, torch.float16)
    copies = {}
    for system in ("baseline", "prefixflow"):
        m = build_model(model, dtype=torch.float32 if autocast else dtype, seed=seed, overrides=overrides)
        apply_ac(m, ac)
        apply_prefixflow(m)
        copies[system] = (m, torch.optim.AdamW(m.parameters(), lr=lr))
    vocab = model_args(copies["baseline"][0]).vocab_size
    gen = torch.Generator().manual_seed(seed)
    rows: list[AlignmentRow] = []
    for step in range(1, steps + 1):
        lens = torch.randint(max(1, suffix_len // 2), suffix_len + 1, (n,), generator=gen).tolist()
        group = synthetic_group(
            vocab, prefix_len, lens, seed=seed * 100_003 + step, with_logprobs=loss == "grpo"
        )
        losses = {}
        for system, (m, opt) in copies.items():
            opt.zero_grad(set_to_none=True)
            device_type = next(m.parameters()).device.type
            with torch.autocast(device_type, dtype=dtype, enabled=autocast):
                stats = train_group(
                    m,
                    group,
                    system=system,
                    layout=layout,
                    microbatch=microbatch,
                    loss=loss,
                    loss_config=loss_config,
                )
            losses[system] = torch.tensor(stats.loss)
        params = {s: list(m.parameters()) for s, (m, _) in copies.items()}
        if step in report:
            rows.append(
                _compare(
                    step, "G", [p.grad for p in params["baseline"]], [p.grad for p in params["prefixflow"]]
                )
            )
            rows.append(_compare(step, "L", [losses["baseline"]], [losses["prefixflow"]]))
        for _, opt in copies.values():
            opt.step()
        if step in report:
            rows.append(
                _compare(
                    step,
                    "W",
                    [p.detach() for p in params["baseline"]],
                    [p.detach() for p in params["prefixflow"]],
                )
            )
    return rows


def format_alignment(rows: list[AlignmentRow]) -> str:
    """Table 3 style text: one line per step with G/L/W max-abs differences and the pass verdict."""
    by_step: dict[int, dict[str, AlignmentRow]] = {}
    for r in rows:
        by_step.setdefault(r.step, {})[r.quantity] = r
    lines = ["step | G max|diff| | L |diff| | W max|diff| | pass"]
    for step in sorted(by_step):
        q = by_step[step]
        ok = all(r.passed for r in q.values())
        lines.append(
            f"{step:4d} | {q['G'].max_abs_diff:.3e} | {q['L'].max_abs_diff:.3e} | {q['W'].max_abs_diff:.3e} | "
            f"{'PASS' if ok else 'FAIL'}"
        )
    return "\n".join(lines)
