"""Measure the stock (unpatched) floor of docs/hybrid.md: how far each stock fp64 computation is from the exact
gradient, and where PrefixFlow sits.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python scripts/hybrid_tolerance.py

transformers computes the hybrids' norms, gates and chunked kernels in fp32 even in an fp64 model. The exact
gradient is the tests' independent full-sequence reference with those casts patched to fp64
(``tests/support/hybrid.fp64_kernels``). Against it, per model (the tests' shapes, seed and group), the largest
max|d|/max|ref| over the parameters (and, for PrefixFlow, over padded/packed x microbatch None/1/2) of:

- HF's own stock full-sequence forward and backward (the stock reference of the tests);
- HF's own stock cached path: per response, the prefix with a ``DynamicCache``, then the suffix from it (the
  cache's in-place state write is replaced by an assignment, so autograd can go back through it);
- PrefixFlow, stock; and PrefixFlow against the stock reference (what the test compared before).

``--fp64-leaves``: PrefixFlow's state leaves (and so the accumulated state gradients) kept in fp64 instead of
the fp32 of HF's kernel output, to see whether the state cache's own rounding contributes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hybrid_equivalence import GROUP, MODELS, Patch  # noqa: E402
from support import hybrid as H  # noqa: E402

import prefixflow as pf  # noqa: E402

RUNS = [(layout, mb) for layout in ("padded", "packed") for mb in (None, 1, 2)]


def _assign(layer):
    def update(recurrent_states, state_idx=0, **kwargs):
        layer.recurrent_states[state_idx] = recurrent_states
        return recurrent_states

    return update


def hf_cached_grads(model, group) -> list[torch.Tensor]:
    """HF's own cached path, one response at a time: prefix ``P - 1`` tokens into a DynamicCache, then
    ``[p_last, r[:-1]]`` from it; loss='pg' by hand as in ``support.hybrid.reference_pg``."""
    from transformers import DynamicCache

    model.zero_grad(set_to_none=True)
    p, head = group.prompt_len, model.get_output_embeddings()
    for i, r in enumerate(group.responses):
        cache = DynamicCache(config=model.config)
        model.base_model(input_ids=group.prompt[:-1].unsqueeze(0), past_key_values=cache, use_cache=True)
        for layer in cache.layers:
            if hasattr(layer, "recurrent_states"):
                layer.update_recurrent_state = _assign(layer)
        suffix = torch.cat([group.prompt[-1:], r[:-1]]).unsqueeze(0)
        pos = torch.arange(p - 1, p - 1 + suffix.shape[1]).unsqueeze(0)
        h = model.base_model(input_ids=suffix, past_key_values=cache, use_cache=True, position_ids=pos)
        logits = head(h.last_hidden_state[0])
        logp = torch.log_softmax(logits.double(), -1).gather(-1, r.unsqueeze(-1)).squeeze(-1)
        (-(group.advantages[i].double() * logp.mean()) / group.n).backward()
    return [q.grad.detach().clone() for q in model.parameters()]


def worst(model, got, want) -> tuple[float, str]:
    out = (0.0, "")
    for (name, _), g, w in zip(model.named_parameters(), got, want, strict=True):
        scale = w.abs().max().item()
        d = (g - w).abs().max().item() / (scale or 1.0)
        out = max(out, (d, name))
    return out


def _fp64_leaves(patch: Patch) -> None:
    from prefixflow.state.recurrent import LayerState, StateCache

    def capture(self, layer, live):
        leaves = {n: t.detach().to(torch.float64).requires_grad_(True) for n, t in live.items()}
        self.layers[layer] = LayerState(dict(live), leaves)

    patch.setattr(StateCache, "capture", capture)


def main() -> None:
    if "--fp64-leaves" in sys.argv:
        _fp64_leaves(Patch())
    print("| model | HF full, stock | HF cached, stock | PrefixFlow, stock | PrefixFlow vs HF full (stock) |")
    print("| --- | --- | --- | --- | --- |")
    for label, (family, types) in MODELS.items():
        model = family(types)
        patch = Patch()
        H.fp64_kernels(patch)
        _, exact = H.reference_pg(model, GROUP)
        patch.undo()
        _, full = H.reference_pg(model, GROUP)
        try:
            cached = f"{worst(model, hf_cached_grads(model, GROUP), exact)[0]:.1e}"
        except Exception as e:  # noqa: BLE001  (HF's cache does not run every layer mix)
            cached = f"n/a ({type(e).__name__})"
        pf.apply_prefixflow(model)
        pf_exact = pf_full = (0.0, "")
        for layout, mb in RUNS:
            model.zero_grad(set_to_none=True)
            pf.train_group(model, GROUP, layout=layout, microbatch=mb)
            got = [q.grad.detach().clone() for q in model.parameters()]
            pf_exact, pf_full = max(pf_exact, worst(model, got, exact)), max(pf_full, worst(model, got, full))
        ref = worst(model, full, exact)
        print(
            f"| {label} | {ref[0]:.1e} ({ref[1]}) | {cached} | {pf_exact[0]:.1e} ({pf_exact[1]}) | "
            f"{pf_full[0]:.1e} |"
        )


if __name__ == "__main__":
    main()
