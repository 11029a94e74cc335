"""Measure what tests/prefixflow/hybrid/ bounds: the hybrid exactness numbers of docs/hybrid.md.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python scripts/hybrid_equivalence.py

For each model (the tests' shapes and seed), the largest relative difference over padded/packed x microbatch
None/1/2 between PrefixFlow and the independent full-sequence reference: stock fp64, and fp64 with HF's fp32
casts patched to fp64. Also the negative controls' smallest gradient error (they must be far from 0).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support import hybrid as H  # noqa: E402

import prefixflow as pf  # noqa: E402
from prefixflow.integrations import hf_state  # noqa: E402
from prefixflow.state import layers as state_layers  # noqa: E402
from prefixflow.state.recurrent import StateCache  # noqa: E402

LIN, FULL = "linear_attention", "full_attention"
MODELS = {
    "qwen3_5 [lin, full, lin]": (H.qwen3_5, (LIN, FULL, LIN)),
    "qwen3_5 [full, lin]": (H.qwen3_5, (FULL, LIN)),
    "qwen3_5 [lin, lin]": (H.qwen3_5, (LIN, LIN)),
    "nemotron_h [mamba, attn, mlp]": (H.nemotron_h, (LIN, FULL, "mlp")),
    "granite-4 hybrid [mamba, attn, mamba]": (H.granite_hybrid, ("mamba", "attention", "mamba")),
    "bamba [mamba, attn]": (lambda types: H.bamba([1], len(types)), (LIN, FULL)),
}
GROUP = pf.synthetic_group(H.VOCAB, 13, [5, 9, 1, 7], seed=3)


class Patch:
    """A minimal stand-in for pytest's monkeypatch, undone by ``undo``."""

    def __init__(self) -> None:
        self.saved = []

    def setattr(self, obj, name, value) -> None:
        self.saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def undo(self) -> None:
        for obj, name, value in reversed(self.saved):
            setattr(obj, name, value)
        self.saved.clear()


def measure(family, types, runs):
    model = family(types)
    ref_loss, ref_grads = H.reference_pg(model, GROUP)
    pf.apply_prefixflow(model)
    worst_loss = worst_grad = 0.0
    for layout, microbatch in runs:
        model.zero_grad(set_to_none=True)
        stats = pf.train_group(model, GROUP, layout=layout, microbatch=microbatch)
        worst_loss = max(worst_loss, abs(stats.loss - ref_loss) / H.loss_scale(GROUP))
        worst_grad = max(worst_grad, H.worst_grad(model, ref_grads)[0])
    return worst_loss, worst_grad


def main() -> None:
    runs = [(layout, mb) for layout in ("padded", "packed") for mb in (None, 1, 2)]
    print("| model | HF casts | loss (rel) | every gradient (max rel) |")
    print("| --- | --- | --- | --- |")
    patch = Patch()
    for patched in (False, True):
        if patched:
            H.fp64_kernels(patch)
        for label, (family, types) in MODELS.items():
            loss, grad = measure(family, types, runs)
            print(f"| {label} | {'fp64' if patched else 'stock'} | {loss:.1e} | {grad:.1e} |")
    faults = {
        "state gradient dropped": (StateCache, "roots", _conv_roots_only),
        "conv tail zeroed": (hf_state.BoundaryCache, "update_conv_state", _zero_tail),
        "packed segments chained": (state_layers, "segment_lengths", lambda mask, hidden: None),
    }
    print("\n| negative control (fp64 casts, packed, microbatch 2) | model | loss (rel) | gradient error |")
    print("| --- | --- | --- | --- |")
    for fault, (obj, name, value) in faults.items():
        for label in ("qwen3_5 [lin, full, lin]", "nemotron_h [mamba, attn, mlp]"):
            one = Patch()
            one.setattr(obj, name, value)
            one.setattr(state_layers, "_MEMO", [None, None])
            loss, grad = measure(*MODELS[label], [("packed", 2)])
            one.undo()
            print(f"| {fault} | {label} | {loss:.1e} | {grad:.1e} |")
    patch.undo()


def _conv_roots_only(self):
    """Phase C seeds the conv tails only: the recurrent state's gradient is dropped."""
    roots, grads = [], []
    for entry in self.layers.values():
        if entry.leaves["conv"].grad is not None:
            roots.append(entry.live["conv"])
            grads.append(entry.leaves["conv"].grad.to(entry.live["conv"].dtype))
    return roots, grads


_UPDATE = hf_state.BoundaryCache.update_conv_state


def _zero_tail(self, conv_states, layer_idx, state_idx=0, **kwargs):
    """Suffixes convolve over zeros instead of the prefix's last inputs."""
    if self.initial is not None:
        self.initial = {**self.initial, "conv": self.initial["conv"].mul(0)}
    return _UPDATE(self, conv_states, layer_idx, state_idx, **kwargs)


if __name__ == "__main__":
    main()
