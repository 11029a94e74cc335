"""Prefix trees on hybrid HF models (fp64, HF's fp32 casts patched to fp64): a node's recurrent state is its
parent's end state run through the node's tokens; children start from it (detached leaves, one per row), and
its gradient flows back through the node's Phase C. Loss and every gradient within 1e-9 of an independent
per-path computation (transformers' own base model, one path at a time)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from support.hybrid import VERIFIED_TRANSFORMERS, fp64_kernels, nemotron_h, qwen3_5, worst_grad  # noqa: E402
from support.tree_reference import random_tree  # noqa: E402

import prefixflow as pf  # noqa: E402
from prefixflow.integrations import hf  # noqa: E402,F401  (registers the HF adapter)
from prefixflow.schedule.caches import CachedKeys  # noqa: E402

pytestmark = VERIFIED_TRANSFORMERS

LIN, FULL = "linear_attention", "full_attention"
MODELS = {
    "qwen3_5-mixed": lambda: qwen3_5((LIN, FULL, LIN)),
    "qwen3_5-full-first": lambda: qwen3_5((FULL, LIN)),
    "nemotron_h": lambda: nemotron_h(("mamba", "attention", "mlp")),
}


def reference_tree_pg(model, tree) -> tuple[float, list[torch.Tensor]]:
    """loss='pg' per path: ``-(1/N) sum_i A_i mean_{t in M_i} log pi(x_it | x_i<t)``, HF's own forward."""
    model.zero_grad(set_to_none=True)
    head, total = model.get_output_embeddings(), 0.0
    for i in range(tree.n):
        tokens = tree.path_tokens(i)
        ts = tree.loss_masks[i].nonzero().flatten()
        hidden = model.base_model(input_ids=tokens[:-1].unsqueeze(0), use_cache=False).last_hidden_state
        logp = torch.log_softmax(head(hidden[0, ts - 1]).double(), dim=-1).gather(-1, tokens[ts, None])
        loss = -(tree.advantages[i].double() * logp.mean()) / tree.n
        loss.backward()
        total += loss.item()
    return total, [p.grad.detach().clone() for p in model.parameters()]


def _train(model, tree, **kwargs):
    model.zero_grad(set_to_none=True)
    return pf.train_group(model, tree, **kwargs).loss


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hybrid_trees_match_the_paths_fp64(name, monkeypatch):
    fp64_kernels(monkeypatch)
    model = pf.apply_prefixflow(MODELS[name]())
    tree = random_tree(13, 3, 3, min_shared_tokens=2)
    assert max(len(tree.path_nodes(i)) for i in range(tree.n)) >= 3  # nodes below nodes: states chain
    want_loss, want = reference_tree_pg(model, tree)
    for system, layout, microbatch in (
        ("baseline", "packed", 2),
        ("prefixflow", "padded", None),
        ("prefixflow", "packed", 1),
        ("prefixflow", "padded", 2),
    ):
        loss = _train(model, tree, system=system, layout=layout, microbatch=microbatch)
        assert abs(loss - want_loss) <= 1e-9 * abs(want_loss), (system, layout, microbatch)
        assert worst_grad(model, want)[0] <= 1e-9, (system, layout, microbatch, worst_grad(model, want))


def test_children_starting_from_the_zero_state_is_caught(monkeypatch):
    """Negative control: every row starts from the zero state instead of its parent's end state."""
    fp64_kernels(monkeypatch)
    model = pf.apply_prefixflow(MODELS["qwen3_5-mixed"]())
    tree = random_tree(13, 3, 3, min_shared_tokens=2)
    want_loss, want = reference_tree_pg(model, tree)
    monkeypatch.setattr(CachedKeys, "states", lambda self, layer, parents: None)
    _train(model, tree, layout="packed", microbatch=2)
    assert worst_grad(model, want)[0] > 1e-3


def test_a_one_token_node_with_children_is_refused_naming_the_fix():
    model = pf.apply_prefixflow(MODELS["nemotron_h"]())
    seqs = [torch.tensor([1, 2, 3, 4, 5]), torch.tensor([1, 2, 3, 6, 7]), torch.tensor([1, 2, 8, 9])]
    tree = pf.build_tree(seqs, [1.0, -1.0, 0.5])  # [1, 2] -> [3] -> ([4, 5], [6, 7]); node [3] is one token
    with pytest.raises(ValueError, match=r"one token long and has children.*min_shared_tokens=2"):
        pf.train_group(model, tree)
    assert all(p.grad is None for p in model.parameters())
    pf.train_group(model, pf.build_tree(seqs, [1.0, -1.0, 0.5], min_shared_tokens=2))
