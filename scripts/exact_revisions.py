"""Loss and gradients of one library revision against another's, case by case, in fp64: bitwise equal, or the
largest per-tensor ‖Δ‖₂/‖ref‖₂. The hybrid model runs with HF's fp32 casts patched to fp64, as its tests do
(``tests/support/hybrid.fp64_kernels``).

One worker process per source tree computes every case (a fresh model per case, the same seed) and writes each
case's loss and gradients to a file in a private temporary folder; the driver reads both (``weights_only``)
and prints one JSON line per case: ``bitwise`` (every tensor and the loss equal bit for bit) and
``max_rel`` (over tensors). Issue 31's rule: bitwise where the summation order did not change, else ≤ 1e-14.

    git worktree add /tmp/before <rev>
    OMP_NUM_THREADS=1 .venv/bin/python scripts/exact_revisions.py --before /tmp/before --after .
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import revision_worker  # scripts/, beside this file

TINY = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256, "max_seq_len": 1024}
# name: (model, input kind, train_group kwargs, model transform)
CASES = {
    "flat-padded-all": ("llama3", "flat", dict(layout="padded", microbatch=None), None),
    "flat-padded-mb1": ("llama3", "flat", dict(layout="padded", microbatch=1), None),
    "flat-packed-mb2": ("llama3", "flat", dict(layout="packed", microbatch=2), None),
    "flat-packed-all": ("llama3", "flat", dict(layout="packed", microbatch=None), None),
    "flat-padded-mb1-offload": ("llama3", "flat", dict(layout="padded", microbatch=1), "offload"),
    "flat-padded-mb2-ac-full": ("llama3", "flat", dict(layout="padded", microbatch=2), "ac-full"),
    "flat-baseline-padded": ("llama3", "flat", dict(layout="padded", microbatch=2, system="baseline"), None),
    "tree-padded-mb1": ("llama3", "tree", dict(layout="padded", microbatch=1), None),
    "tree-packed-all": ("llama3", "tree", dict(layout="packed", microbatch=None), None),
    "tree-packed-mb2": ("llama3", "tree", dict(layout="packed", microbatch=2), None),
    "tree-baseline-packed": (
        "llama3",
        "tree",
        dict(layout="packed", microbatch=None, system="baseline"),
        None,
    ),
    "hybrid-flat-packed-mb1": ("qwen3_5", "flat", dict(layout="packed", microbatch=1), None),
    "hybrid-tree-packed-mb2": ("qwen3_5", "tree", dict(layout="packed", microbatch=2), None),
}


def _case(name: str):
    import torch

    import prefixflow as pf

    family, kind, kwargs, transform = CASES[name]
    if family == "llama3":
        model = pf.build_model("llama3:debugmodel", dtype=torch.float64, seed=0, overrides=TINY)
        vocab = TINY["vocab_size"]
    else:
        from prefixflow.integrations import hf

        model = hf.build_hf_model("qwen3_5-tiny", dtype=torch.float64, seed=0)
        vocab = hf.hf_config("qwen3_5-tiny").vocab_size
    if transform == "ac-full":
        pf.apply_ac(model, "full")
    model = pf.apply_prefixflow(model, pf.PrefixFlowConfig(offload=transform == "offload"))
    if kind == "flat":
        data = pf.synthetic_group(vocab, 96, [24, 17, 31, 9], seed=0)
    else:
        from harness.workloads import AgenticShape

        shape = AgenticShape(
            system_len=48, turns=2, assistant_len=8, reply_len=12, branch=2, branch_at=[0, 1]
        )
        data = shape.generate(vocab).tree(min_shared_tokens=2 if family == "qwen3_5" else 1)
    return model, data, kwargs


def worker(folder: str, cases: list[str]) -> None:
    import pytest
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, os.path.join(os.getcwd(), "tests"))  # this revision's tests/support
    from support.hybrid import fp64_kernels

    fp64_kernels(pytest.MonkeyPatch())  # HF's fp32 casts in the hybrid kernels: fp64, as the tests run them
    for name in cases:
        model, data, kwargs = _case(name)
        stats = __import__("prefixflow").train_group(model, data, **kwargs)
        grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
        torch.save({"loss": torch.tensor(float(stats.loss), dtype=torch.float64), **grads},
                   os.path.join(folder, f"{name}.pt"))  # fmt: skip
    print("done", flush=True)


def _run(root: str, folder: str, cases: list[str]) -> None:
    proc = revision_worker.start(root, __file__, folder, "--cases", ",".join(cases))
    if proc.wait() != 0:
        raise subprocess.CalledProcessError(proc.returncode, f"{__file__} --worker in {root}")


def compare(before: str, after: str, cases: list[str]) -> list[dict]:
    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folders = {rev: os.path.join(tmp, rev) for rev in ("before", "after")}
        for rev, root in (("before", before), ("after", after)):
            os.mkdir(folders[rev], 0o700)
            _run(root, folders[rev], cases)
        for name in cases:
            a, b = (torch.load(os.path.join(folders[r], f"{name}.pt"), weights_only=True) for r in folders)
            if set(a) != set(b):
                raise RuntimeError(f"{name}: the revisions give gradients to different parameters")
            bitwise = all(torch.equal(a[k], b[k]) for k in a)
            rel = max(float((a[k] - b[k]).norm() / a[k].norm().clamp_min(1e-300)) for k in a)
            rows.append(dict(case=name, bitwise=bitwise, max_rel=rel, tensors=len(a), loss=float(a["loss"])))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--before")
    parser.add_argument("--after", default=".")
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    cases = args.cases.split(",")
    if unknown := [c for c in cases if c not in CASES]:
        parser.error(f"--cases: unknown {unknown}; valid: {', '.join(CASES)}")
    if args.worker:
        worker(args.worker, cases)
        return
    if not args.before:
        parser.error("--before is required")
    rows = compare(args.before, args.after, cases)
    worst = (
        max(r["max_rel"] for r in rows if not r["bitwise"]) if any(not r["bitwise"] for r in rows) else 0.0
    )
    print(json.dumps({"bitwise": sum(r["bitwise"] for r in rows), "cases": len(rows), "worst_rel": worst}))


if __name__ == "__main__":
    main()
