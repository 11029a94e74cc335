"""Negative controls for the recurrent-state cache: each injected fault must move the gradients far past the
exactness tolerance (fp64, HF's casts patched), so the exactness tests would catch it.

- the state gradient dropped (Phase C seeds only the conv tail);
- the conv tail zeroed (suffixes convolve over zeros instead of the prefix's last inputs);
- packed segments chained (one recurrence over the whole packed row instead of a restart per response);
- the recurrent state never handed to the suffixes (they start from zero).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from support.hybrid import (  # noqa: E402
    VERIFIED_TRANSFORMERS,
    VOCAB,
    fp64_kernels,
    granite_hybrid,
    loss_scale,
    nemotron_h,
    qwen3_5,
    reference_pg,
    worst_grad,
)

import prefixflow as pf  # noqa: E402
from prefixflow.integrations import hf_state  # noqa: E402
from prefixflow.state import layers as state_layers  # noqa: E402
from prefixflow.state.recurrent import StateCache  # noqa: E402

pytestmark = VERIFIED_TRANSFORMERS

LIN, FULL = "linear_attention", "full_attention"
FAMILIES = {
    "qwen3_5": (qwen3_5, (LIN, FULL, LIN)),
    "nemotron_h": (nemotron_h, (LIN, FULL, "mlp")),
    "granite_hybrid": (granite_hybrid, ("mamba", "attention", "mamba")),
}
GROUP = pf.synthetic_group(VOCAB, 13, [5, 9, 1, 7], seed=3)


def _errors(name, layout="packed"):
    family, types = FAMILIES[name]
    model = family(types)
    ref_loss, ref_grads = reference_pg(model, GROUP)
    pf.apply_prefixflow(model)
    model.zero_grad(set_to_none=True)
    stats = pf.train_group(model, GROUP, layout=layout, microbatch=2)
    return abs(stats.loss - ref_loss) / loss_scale(GROUP), worst_grad(model, ref_grads)[0]


def _drop_recurrent_grad(self):
    roots, grads = [], []
    for entry in self.layers.values():
        live, leaf = entry.live["conv"], entry.leaves["conv"]
        if leaf.grad is not None:
            roots.append(live)
            grads.append(leaf.grad.to(live.dtype))
    return roots, grads


def _zero_tail(original):
    def update(self, conv_states, layer_idx, state_idx=0, **kwargs):
        if self.initial is not None:
            self.initial = {**self.initial, "conv": torch.zeros_like(self.initial["conv"])}
        return original(self, conv_states, layer_idx, state_idx, **kwargs)

    return update


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_faults_fail(monkeypatch, name):
    fp64_kernels(monkeypatch)
    loss, grad = _errors(name)
    assert loss <= 1e-9 and grad <= 1e-9  # the unfaulted run passes

    with monkeypatch.context() as m:
        m.setattr(StateCache, "roots", _drop_recurrent_grad)
        loss, grad = _errors(name)
        assert loss <= 1e-9, "dropping a gradient leaves the forward alone"
        assert grad > 1e-3, f"state gradient dropped: {grad:.1e}"

    with monkeypatch.context() as m:
        m.setattr(
            hf_state.BoundaryCache, "update_conv_state", _zero_tail(hf_state.BoundaryCache.update_conv_state)
        )
        loss, grad = _errors(name)
        assert loss > 1e-6 and grad > 1e-3, f"conv tail zeroed: loss {loss:.1e} grad {grad:.1e}"

    with monkeypatch.context() as m:
        m.setattr(state_layers, "segment_lengths", lambda mask, hidden: None)
        m.setattr(state_layers, "_MEMO", [None, None])
        loss, grad = _errors(name, layout="packed")
        assert loss > 1e-6 and grad > 1e-3, f"packed segments chained: loss {loss:.1e} grad {grad:.1e}"

    with monkeypatch.context() as m:
        m.setattr(StateCache, "read", lambda self, layer: None)
        loss, grad = _errors(name, layout="padded")
        assert loss > 1e-6 and grad > 1e-3, f"suffixes from the zero state: loss {loss:.1e} grad {grad:.1e}"
