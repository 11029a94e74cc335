"""Multi-step alignment (paper Table 3): baseline and PrefixFlow copies trained side by side, with negative controls.

Every copy starts from the same seed, sees the same groups and takes AdamW steps with the same settings. At
the reported steps each PrefixFlow copy is compared with the baseline on the gradients before the step (G),
the loss (L) and the weights after the step (W):

- **The paper's rule**, elementwise: ``|x - y| <= tau_abs + tau_rel * max(|x|, |y|)`` on every matched element.
- **Normwise**, per parameter tensor: ``||x - y||_2 / max(||x||_2, ||y||_2)``, the largest over tensors (G),
  over the cumulative update ``W_t - W_0`` (W), or ``|x - y| / max(|x|, |y|)`` (L). For G it must stay within
  ``sqrt(2) * tau_rel``, the normwise bound the paper's relative term implies when no element gets the
  absolute slack ``tau_abs`` (``|x_i - y_i| <= tau_rel max(|x_i|, |y_i|)`` for all ``i`` gives
  ``||x - y|| <= sqrt(2) tau_rel max(||x||, ||y||)``). That slack is what lets the elementwise rule pass a tensor
  whose elements are all small, e.g. a layer that lost part of its prefix gradient. For L (a scalar that
  crosses zero) and W (Adam turns rounding noise in near-zero gradients into ``±lr`` steps) the normwise
  difference is reported, not ruled on.
- **Tolerances per dtype** (:func:`tolerances`). bf16 rows use the paper's ``tau_abs = 1e-3, tau_rel = 1e-2``
  (about 2.56 bf16 unit roundoffs: mixed precision rounds matmul inputs to bf16 and sums in fp32). Rows whose
  dtype sums in its own precision use the same multiple of that dtype's unit roundoff ``u``, grown by the
  usual ``sqrt(n)`` of an ``n``-term sum (``n``: the tokens the baseline's weight gradients sum over):
  ``tau = tau_paper * (u / u_bf16) * (1 + sqrt(n))``.
- **The loss's scale**: a sum's rounding grows with the magnitudes it is summed from, not with the sum (a loss
  that nearly cancels has terms much larger than itself). L's relative term is taken of
  ``max(|x|, |y|, M)``, ``M`` = the baseline's loss on the same group with every advantage replaced by its
  absolute value (for ``pg``: exactly the sum of its terms' absolute values; for ``grpo``: within the clip
  range), computed at the reported steps from the baseline's weights before its step. G's normwise rule is
  unchanged, so every negative control still fails on G.
- **MoE** models train under Rollout Routing Replay, as the paper's MoE row: each step the baseline copy
  records the group's routing (:func:`prefixflow.record_routing`, the rollout's masks) and every copy
  replays them.
- **Negative controls** (``controls``): PrefixFlow copies with an injected fault (:mod:`prefixflow.checks.faults`).
  Each must FAIL; its ``margin`` is its G normwise difference over the correct run's at the same step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace

import torch

from ..group import synthetic_group
from ..hooks import add_hooks
from ..memory.limit import MemoryRefusal, memory_limit
from ..model.apply import apply_ac, apply_prefixflow
from ..model.dtypes import dtype_name
from ..model.models import build_model, count_parameters, model_args
from ..moe import is_moe, record_routing
from ..schedule.driver import train_group
from .faults import FAULTS, make_fault

__all__ = [
    "AlignmentRow",
    "CONTROLS",
    "run_alignment",
    "alignment_rows",
    "GroupDraw",
    "passes",
    "tolerances",
    "normwise",
    "format_alignment",
]

TAU_ABS = 1e-3
TAU_REL = 1e-2
CORRECT = "prefixflow"  # the run name of the unfaulted PrefixFlow copy
CONTROLS = tuple(FAULTS)
_MIXED = (torch.bfloat16, torch.float16)  # run as autocast over fp32 master weights
NORM_FACTOR = math.sqrt(2.0)  # normwise G bound: NORM_FACTOR * tau_rel (module doc)


@dataclass
class AlignmentRow:
    """One quantity of one run at one step. ``passed`` is the verdict (paper rule, and normwise for G)."""

    step: int
    quantity: str  # "G" gradients, "L" loss, "W" after-update weights
    max_abs_diff: float
    max_abs_value: float
    passed: bool
    run: str = CORRECT  # CORRECT, or the name of a negative control
    dtype: str = ""
    norm_rel_diff: float = math.nan  # G: max over tensors; W: of the update W_t - W_0; L: relative
    norm_tol: float = math.nan  # the normwise bound G is ruled on (NaN for L and W: reported only)
    worst_tensor: str = ""  # the parameter with the largest normwise difference
    tau_abs: float = TAU_ABS
    tau_rel: float = TAU_REL
    paper_pass: bool = True  # the elementwise rule alone
    margin: float = math.nan  # controls, G: norm_rel_diff over the correct run's

    def as_dict(self) -> dict:
        return asdict(self)


def _unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def tolerances(dtype: torch.dtype, n_terms: int) -> tuple[float, float]:
    """``(tau_abs, tau_rel)`` for a run in ``dtype`` whose gradients sum ``n_terms`` token terms.

    bf16/fp16 (mixed precision, fp32 sums): the paper's ``(1e-3, 1e-2)`` rescaled by ``u / u_bf16``.
    Other dtypes sum in their own precision: additionally ``x (1 + sqrt(n_terms))``.
    """
    scale = _unit_roundoff(dtype) / _unit_roundoff(torch.bfloat16)
    if dtype not in _MIXED:
        scale *= 1.0 + math.sqrt(max(1, n_terms))
    return TAU_ABS * scale, TAU_REL * scale


def passes(
    x: torch.Tensor, y: torch.Tensor, tau_abs: float = TAU_ABS, tau_rel: float = TAU_REL, scale: float = 0.0
) -> bool:
    """The paper's elementwise rule, on every matched element; ``scale``: a magnitude the values are summed
    from (the loss: its terms' absolute sum), which bounds their rounding when it exceeds them."""
    x, y = x.double(), y.double()
    return bool(((x - y).abs() <= tau_abs + tau_rel * torch.maximum(x.abs(), y.abs()).clamp(min=scale)).all())


def normwise(x: torch.Tensor, y: torch.Tensor) -> float:
    """``||x - y||_2 / max(||x||_2, ||y||_2)`` (0 when both are zero)."""
    x, y = x.double(), y.double()
    scale = max(float(x.norm()), float(y.norm()))
    return float((x - y).norm()) / scale if scale > 0 else 0.0


def _compare(step, quantity, xs, ys, names, tau, dtype, run, rule_norm, scale=None) -> AlignmentRow:
    pairs = [(x.double(), y.double()) for x, y in zip(xs, ys, strict=True)]
    diff = max(float((x - y).abs().max()) for x, y in pairs)
    top = max(float(torch.maximum(x.abs(), y.abs()).max()) for x, y in pairs)
    paper = all(passes(x, y, *tau, scale=scale or 0.0) for x, y in pairs)
    rels = [normwise(x, y) for x, y in pairs]
    worst = max(range(len(rels)), key=rels.__getitem__)
    norm_tol = NORM_FACTOR * tau[1] if rule_norm else math.nan
    return AlignmentRow(
        step=step,
        quantity=quantity,
        max_abs_diff=diff,
        max_abs_value=top,
        passed=paper and not rels[worst] > norm_tol,
        run=run,
        dtype=dtype,
        norm_rel_diff=rels[worst],
        norm_tol=norm_tol,
        worst_tensor=names[worst],
        tau_abs=tau[0],
        tau_rel=tau[1],
        paper_pass=paper,
    )


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
    controls: Iterable[str] = (),
    device: str | torch.device = "cpu",
) -> list[AlignmentRow]:
    """Train a baseline copy, a PrefixFlow copy and one PrefixFlow copy per negative control for ``steps``
    AdamW steps on ``device`` on the same synthetic groups (response lengths vary in ``[suffix_len // 2,
    suffix_len]``); return G/L/W rows at ``report_steps`` for the correct run, then for each control (see the
    module doc)."""
    report = set(report_steps)
    if steps < 1 or not report or min(report) < 1 or max(report) > steps:
        raise ValueError(f"report_steps {sorted(report)} must lie in [1, steps={steps}]")
    controls = list(controls)
    unknown = sorted(set(controls) - set(CONTROLS))
    if unknown:
        raise ValueError(f"unknown control(s) {unknown}; valid controls: {list(CONTROLS)}")
    if "microbatch_loss_scale" in controls and (microbatch is None or microbatch >= n):
        raise ValueError(
            f"the microbatch_loss_scale control needs several microbatches: microbatch={microbatch} "
            f"must be an int below n={n} (e.g. microbatch=1)"
        )
    # bf16/fp16 run as mixed precision: fp32 master weights and optimizer, forward/backward under autocast.
    autocast = dtype in _MIXED
    runs = {"baseline": None, CORRECT: None, **{c: c for c in controls}}
    _check_memory(model, overrides, torch.float32 if autocast else dtype, len(runs))
    copies = {}
    for run, fault in runs.items():
        m = build_model(
            model, dtype=torch.float32 if autocast else dtype, seed=seed, overrides=overrides, device=device
        )
        apply_ac(m, ac)
        apply_prefixflow(m)
        if fault is not None:
            add_hooks(m, make_fault(fault))
        copies[run] = m
    base = copies["baseline"]
    draw = GroupDraw(model_args(base).vocab_size, prefix_len, suffix_len, n, seed, loss == "grpo")

    def groups_of(step: int) -> list:
        (group,) = draw(step, 1)
        if is_moe(base):  # the rollout's masks: the baseline copy records them, every copy replays them
            with torch.autocast(next(base.parameters()).device.type, dtype=dtype, enabled=autocast):
                group = replace(group, routing=record_routing(base, group))
        return [group]

    def train(m, groups: list, system: str):
        (group,) = groups
        return train_group(
            m, group, system=system, layout=layout, microbatch=microbatch, loss=loss, loss_config=loss_config
        )

    return alignment_rows(copies, groups_of, train, steps=steps, report=report, dtype=dtype, lr=lr)


class GroupDraw:
    """The synthetic groups of every alignment run: group ``g`` of step ``s`` (response lengths in
    ``[suffix_len // 2, suffix_len]``), the same for one process and a parallel layout (its group 0)."""

    def __init__(self, vocab: int, prefix_len: int, suffix_len: int, n: int, seed: int, logprobs: bool):
        self.vocab, self.prefix_len, self.suffix_len, self.n = vocab, prefix_len, suffix_len, n
        self.seed, self.logprobs = seed, logprobs
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, step: int, k: int) -> list:
        groups = []
        for g in range(k):
            lens = torch.randint(
                max(1, self.suffix_len // 2), self.suffix_len + 1, (self.n,), generator=self.gen
            ).tolist()
            seed = self.seed * 100_003 + step + 1_000_003 * g
            groups.append(
                synthetic_group(self.vocab, self.prefix_len, lens, seed=seed, with_logprobs=self.logprobs)
            )
        return groups


def alignment_rows(
    copies: dict,
    groups_of,
    train,
    *,
    steps: int,
    report: set[int],
    dtype: torch.dtype,
    lr: float,
    full=lambda t: t,
) -> list[AlignmentRow]:
    """The one alignment loop (one process or a parallel layout): ``copies`` (run name -> model: the
    baseline, the correct PrefixFlow copy, the controls) each take ``steps`` AdamW steps on ``groups_of(step)``
    (``train(model, groups, system)`` trains one step's groups into ``.grad``); at the ``report`` steps each
    PrefixFlow copy is compared with the baseline. ``full``: a parameter or gradient as the full tensor (a
    sharded one gathered)."""
    autocast = dtype in _MIXED
    names = [_name(n) for n, _ in copies["baseline"].named_parameters()]
    state = {
        run: (m, torch.optim.AdamW(m.parameters(), lr=lr), [full(p.detach()).clone() for p in m.parameters()])
        for run, m in copies.items()
    }
    rows: list[AlignmentRow] = []
    for step in range(1, steps + 1):
        groups = groups_of(step)
        tau = tolerances(dtype, sum(g.prompt_len + s - 1 for g in groups for s in g.response_lens))
        seen, loss_scale = {}, None
        for run, (m, opt, start) in state.items():
            device_type = next(m.parameters()).device.type
            if run == "baseline" and step in report:  # L's scale: the magnitudes its terms are summed from
                opt.zero_grad(set_to_none=True)
                absolute = [replace(g, advantages=g.advantages.abs()) for g in groups]
                with torch.autocast(device_type, dtype=dtype, enabled=autocast):
                    loss_scale = abs(train(m, absolute, "baseline").loss)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device_type, dtype=dtype, enabled=autocast):
                stats = train(m, groups, "baseline" if run == "baseline" else "prefixflow")
            grads = [full(p.grad).detach().clone() for p in m.parameters()] if step in report else None
            opt.step()
            weights = [full(p.detach()) for p in m.parameters()] if step in report else None
            seen[run] = (grads, torch.tensor(stats.loss, dtype=torch.float64), weights, start)
        if step in report:
            rows += _step_rows(step, seen, names, tau, dtype_name(dtype), loss_scale)
    return rows


def _name(n: str) -> str:
    return n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


# Per trained copy: weights, their start, AdamW's two moments, .grad and its reported clone.
_TENSORS_PER_PARAM = 6


def _available_bytes() -> int | None:
    limit = memory_limit()
    return None if limit is None else limit.bytes


def _check_memory(model: str, overrides: dict | None, dtype: torch.dtype, copies: int) -> None:
    """Refuse, before any model is built, a comparison whose copies cannot fit in the memory this process may
    take (``prefixflow.memory.limit``: MemAvailable, ulimit -v, the cgroup, $PF_MEMORY_LIMIT; the default
    qwen3:debugmodel_moe is 316M parameters: 6 fp64 copies need ~90 GiB)."""
    available = _available_bytes()
    if available is None:
        return
    n_params = count_parameters(model, overrides)
    need = n_params * dtype.itemsize * _TENSORS_PER_PARAM * copies
    if need > available:
        raise MemoryRefusal(
            f"{model} has {n_params / 1e6:.0f}M parameters: {copies} trained copies in {dtype_name(dtype)} need "
            f"about {need / 2**30:.1f} GiB, more than the {available / 2**30:.1f} GiB available; shrink the "
            "model with --override (e.g. dim=64, n_layers=2)"
            + (", or drop the controls" if copies > 2 else "")
        )


def _step_rows(step, state, names, tau, dtype, loss_scale=None) -> list[AlignmentRow]:
    base_g, base_l, base_w, base_w0 = state["baseline"]
    out, correct_g = [], None
    for run, (g, loss_value, w, w0) in state.items():
        if run == "baseline":
            continue
        rows = [
            _compare(step, "G", base_g, g, names, tau, dtype, run, rule_norm=True),
            _compare(step, "L", [base_l], [loss_value], ["loss"], tau, dtype, run, False, loss_scale),
            _compare(step, "W", base_w, w, names, tau, dtype, run, rule_norm=False),
        ]
        # W's normwise difference is of the update since step 0 (the weights themselves are mostly init).
        updates = [(a - a0, b - b0) for a, a0, b, b0 in zip(base_w, base_w0, w, w0, strict=True)]
        rels = [normwise(a, b) for a, b in updates]
        worst = max(range(len(rels)), key=rels.__getitem__)
        rows[2].norm_rel_diff, rows[2].worst_tensor = rels[worst], names[worst]
        if run == CORRECT:
            correct_g = rows[0].norm_rel_diff
        elif correct_g:
            rows[0].margin = rows[0].norm_rel_diff / correct_g
        out += rows
    return out


def format_alignment(rows: list[AlignmentRow]) -> str:
    """Table 3 style text: one line per run and step, max-abs and normwise differences, and the verdict."""
    by_key: dict[tuple[str, int], dict[str, AlignmentRow]] = {}
    for r in rows:
        by_key.setdefault((r.run, r.step), {})[r.quantity] = r
    lines = [
        "run                    | step | G max|d|  | G norm    | L |d|     | W max|d|  | W(upd) norm | result"
    ]
    for (run, step), q in by_key.items():
        ok = all(r.passed for r in q.values())
        verdict = "PASS" if ok else "FAIL"
        if run != CORRECT and math.isfinite(q["G"].margin):
            verdict += f" (x{q['G'].margin:.0f} the correct run's G)"
        lines.append(
            f"{run:22s} | {step:4d} | {q['G'].max_abs_diff:.3e} | {q['G'].norm_rel_diff:.3e} | "
            f"{q['L'].max_abs_diff:.3e} | {q['W'].max_abs_diff:.3e} | {q['W'].norm_rel_diff:.3e}   | {verdict}"
        )
    return "\n".join(lines)
