"""Measure what tests/prefixflow/integrations/test_hf.py and tests/prefixflow/integrations/test_trl.py bound: the HF/TRL equivalence numbers of docs/hf-trl.md.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python scripts/hf_equivalence.py

Prints the largest relative difference seen per comparison (same helpers, shapes and seeds as the tests).
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import test_hf as H  # noqa: E402
import test_trl as T  # noqa: E402
from support.reference import max_rel_diff  # noqa: E402

import prefixflow as pf  # noqa: E402


def hf_rows() -> list[str]:
    rows = []
    group = H.GROUP
    for label, dtype, norms in (("fp64", torch.float64, False), ("fp64, fp64 norms", torch.float64, True)):
        worst_loss = worst_grad = 0.0
        for family in H.FAMILIES:
            for tied in (False, True):
                model = H.make_model(family, dtype=dtype, tied=tied)
                if norms:
                    H.fp64_norms(model)
                want_loss, want = H.reference_pg(model, group)
                pf.apply_prefixflow(model)
                for layout in ("padded", "packed"):
                    for microbatch in (None, 1):
                        model.zero_grad(set_to_none=True)
                        stats = pf.train_group(model, group, layout=layout, microbatch=microbatch)
                        worst_loss = max(worst_loss, abs(stats.loss - want_loss) / abs(want_loss))
                        worst_grad = max(worst_grad, max_rel_diff(H.grads(model), want))
        rows.append(
            f"| HF {label}, 4 families x tied/untied x padded/packed x microbatch None/1 | "
            f"{worst_loss:.1e} | {worst_grad:.1e} |"
        )
    worst_loss = worst_grad = 0.0
    for family in ("llama", "qwen3"):
        model = H.make_model(family, dtype=torch.float32)
        want_loss, want = H.reference_pg(model, group)
        pf.apply_prefixflow(model)
        for layout in ("padded", "packed"):
            model.zero_grad(set_to_none=True)
            stats = pf.train_group(model, group, layout=layout, microbatch=1)
            worst_loss = max(worst_loss, abs(stats.loss - want_loss) / H.loss_scale(group))
            worst_grad = max(worst_grad, max_rel_diff(H.grads(model), want))
    rows.append(
        f"| HF fp32, llama + qwen3, padded/packed (loss vs its scale, see test_hf.loss_scale) | "
        f"{worst_loss:.1e} | {worst_grad:.1e} |"
    )
    return rows


def trl_rows(tmp: Path) -> list[str]:
    rows = []
    for case, options in sorted(T.CASES.items()):
        options = dict(options)
        beta = options.pop("beta", 0.0)
        tr = T.trainer(tmp / case, **options)
        inputs = T.micro_batch(tr)
        tr.beta = beta
        model = tr.model
        model.zero_grad(set_to_none=True)
        want_loss = tr.compute_loss(model, inputs)
        want_loss.backward()
        want = T.grads(model)
        model.zero_grad(set_to_none=True)
        got_loss = tr._prefixflow_update(model, inputs)
        loss_rel = abs(float(got_loss) - float(want_loss)) / abs(float(want_loss))
        rows.append(
            f"| TRL `_compute_loss` on one micro-batch (fp32), {case} | {loss_rel:.1e} | {max_rel_diff(T.grads(model), want):.1e} |"
        )
    for loss_type in T.LOSS_TYPES:
        result = {}
        for cls in (T.PrefixFlowGRPOTrainer.__mro__[1], T.PrefixFlowGRPOTrainer):
            tr = T.trainer(tmp / f"{loss_type}-{cls.__name__}", cls=cls, loss_type=loss_type)
            before = [p.detach().clone() for p in tr.model.parameters()]
            with contextlib.redirect_stdout(io.StringIO()):  # the Trainer prints its log lines
                tr.train()
            after = [p.detach().clone() for p in tr.model.parameters()]
            result[cls] = (after, [a - b for a, b in zip(after, before, strict=True)])
        (base, base_step), (got, got_step) = result.values()
        rows.append(
            f"| one SGD step, GRPOTrainer vs PrefixFlowGRPOTrainer, {loss_type} (fp32) | "
            f"{max_rel_diff(got, base):.1e} | {max_rel_diff(got_step, base_step):.1e} |"
        )
    return rows


def main() -> None:
    import tempfile

    print(
        "| comparison | loss, or parameters after the step (rel) | every gradient, or the update (max rel) |"
    )
    print("| --- | --- | --- |")
    for row in hf_rows():
        print(row, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for row in trl_rows(Path(tmp)):
            print(row, flush=True)


if __name__ == "__main__":
    main()
