"""Why an fp32 frozen-trace replay differs: gradient accuracy of each trainer against float64, and the first
AdamW step's sensitivity to it (Claim 2.2's fp32 check, docs/claim2.md).

    python -m harness.rl.precision results/claim2/cpu/_state/traces/baseline-fp32-s0 [--step 1]

Accumulates the gradients of one traced step's groups from the trace's initial weights with the baseline
and PrefixFlow, in fp32 and fp64, and prints each parameter's relative gradient error against the fp64
baseline; then the element where the two fp32 trainers' first AdamW updates (``lr * g / (|g| + eps)``)
differ most, with its three gradients."""

from __future__ import annotations

import argparse

import torch

import prefixflow as pf
from harness.rl.io import TraceError, load_weights
from harness.rl.trace import Trace, load_trace
from prefixflow.rl import named_parameters


def step_gradients(trace: Trace, step: int, system: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The summed gradients of traced step ``step``'s groups at the trace's initial weights (fp64 copies)."""
    m = trace.manifest
    model = pf.build_model(m.model, dtype=dtype, seed=m.seed, overrides=m.overrides)
    pf.apply_prefixflow(model, pf.PrefixFlowConfig(attention=m.attention))
    initial = trace.tensors(m.initial)
    load_weights(model, {k: v.to(dtype) for k, v in initial.items() if k.startswith("w.")}, "initial", "w.")
    for group in trace.groups(m.steps[step - 1]):
        pf.train_group(
            model,
            group,
            system=system,
            layout=m.layout,
            microbatch=m.microbatch,
            loss="grpo",
            loss_config=dict(m.loss_config),
        )
    return {name: p.grad.double() for name, p in named_parameters(model).items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="an fp32 trace folder (pf-bench rl writes them under _state/traces/)")
    parser.add_argument("--step", type=int, default=1, help="the traced step (1 = AdamW's first step)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    try:
        trace = load_trace(args.trace)
    except TraceError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")  # one line naming the folder, no traceback
    if not 1 <= args.step <= len(trace.manifest.steps):
        parser.error(f"--step must be in 1..{len(trace.manifest.steps)}")
    try:
        runs = {
            (system, name): step_gradients(trace, args.step, system, dtype)
            for system in ("baseline", "prefixflow")
            for name, dtype in (("fp32", torch.float32), ("fp64", torch.float64))
        }
    except TraceError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    truth = runs[("baseline", "fp64")]
    cols = [k for k in runs if k != ("baseline", "fp64")]
    print("relative gradient error vs the fp64 baseline, ||g - g64|| / ||g64||, per parameter")
    print(f"{'parameter':38s} " + " ".join(f"{s[:10]}-{d}" for s, d in cols))
    for name, g64 in truth.items():
        norm = g64.norm()
        errs = [float((runs[c][name] - g64).norm() / norm) if norm > 0 else 0.0 for c in cols]
        print(f"{name:38s} " + " ".join(f"{e:15.1e}" for e in errs))
    eps = trace.manifest.optimizer.eps

    def first_update(g: torch.Tensor) -> torch.Tensor:  # AdamW's first bias-corrected step, in units of lr
        return g / (g.abs() + eps)

    base, ours = runs[("baseline", "fp32")], runs[("prefixflow", "fp32")]
    name = max(truth, key=lambda n: float((first_update(ours[n]) - first_update(base[n])).abs().max()))
    i = int((first_update(ours[name]) - first_update(base[name])).abs().argmax())
    print(
        f"largest first-step difference: {name}[{i}]: gradient fp64 {float(truth[name].flatten()[i]):.3e}, "
        f"baseline fp32 {float(base[name].flatten()[i]):.3e}, PrefixFlow fp32 {float(ours[name].flatten()[i]):.3e}"
        f"; update {float(first_update(base[name]).flatten()[i]):+.2f} lr vs "
        f"{float(first_update(ours[name]).flatten()[i]):+.2f} lr (eps {eps:g})"
    )


if __name__ == "__main__":
    main()
