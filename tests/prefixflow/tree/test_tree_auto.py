"""``build_tree(min_shared_tokens="auto")``: a shared node is split out only when the recomputation it saves,
``(heirs - 1) * tokens``, reaches ``AUTO_NODE_COST_TOKENS``; the default stays 1; training stays exact."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from support.reference import max_rel_diff

import prefixflow as pf
from prefixflow.tree.build import AUTO_NODE_COST_TOKENS as TAU


def seqs(shared: int, heirs: int, prompt: int = 60, leaf: int = 5):
    """A prompt, two shared nodes of ``shared`` tokens under it, ``heirs`` leaves under each."""
    gen = torch.Generator().manual_seed(shared * 7 + heirs)

    def draw(n: int) -> torch.Tensor:
        return torch.randint(0, 97, (n,), generator=gen)

    root, out = draw(prompt), []
    for _ in range(2):
        node = draw(shared)
        out += [torch.cat([root, node, draw(leaf)]) for _ in range(heirs)]
    masks = [torch.arange(s.numel()) >= prompt for s in out]
    return out, masks, torch.randn(len(out), generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("heirs", [2, 3])
def test_auto_splits_exactly_where_the_saved_work_reaches_the_cost(heirs):
    shortest = -(-TAU // (heirs - 1))  # the least length with (heirs - 1) * length >= TAU
    for length, split in [(shortest - 1, False), (shortest, True)]:
        s, m, a = seqs(length, heirs)
        auto = pf.build_tree(s, a, loss_masks=m, min_shared_tokens="auto")
        # the root (60 tokens, 2 heirs: kept), then each shared node and its leaves (split) or the leaves
        # holding its tokens (merged)
        assert auto.n_nodes == (1 + 2 * (1 + heirs) if split else 1 + 2 * heirs), (length, heirs)
        assert pf.build_tree(s, a, loss_masks=m).n_nodes == 1 + 2 * (
            1 + heirs
        )  # the default splits every node


def test_auto_trees_train_exactly():
    model = tiny_model("llama3")
    s, m, a = seqs(TAU - 1, 2)
    s2, m2, a2 = seqs(TAU + 3, 2)
    tree = pf.build_tree(s + s2, torch.cat([a, a2]), loss_masks=m + m2, min_shared_tokens="auto")
    grads = {}
    for system in ("baseline", "prefixflow"):
        model.zero_grad(set_to_none=True)
        loss = pf.train_group(model, tree, system=system).loss
        grads[system] = (loss, [p.grad.clone() for p in model.parameters()])
    assert abs(grads["baseline"][0] - grads["prefixflow"][0]) <= 1e-9
    assert max_rel_diff(grads["prefixflow"][1], grads["baseline"][1]) <= 1e-9


def test_auto_is_the_only_string():
    s, m, a = seqs(4, 2)
    with pytest.raises(ValueError, match="'auto'"):
        pf.build_tree(s, a, loss_masks=m, min_shared_tokens="fast")
