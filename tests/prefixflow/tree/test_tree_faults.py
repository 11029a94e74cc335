"""The tree exactness check catches the issue's three negative controls: each fault, patched in, moves the
loss or a gradient far past 1e-9 from the independent per-path reference."""

from __future__ import annotations

import dataclasses

import torch
from conftest import tiny_model
from support.reference import max_rel_diff
from support.tree_reference import random_tree, reference_tree

import prefixflow as pf
from prefixflow.schedule.caches import CachedKeys
from prefixflow.tree.plan import TreeRows


def error_of(model, tree) -> float:
    """max(loss error, worst gradient error) of PrefixFlow on ``tree`` against the reference."""
    want_loss, want = reference_tree(model, tree)
    model.zero_grad(set_to_none=True)
    stats = pf.train_group(model, tree, microbatch=2)
    got = [p.grad for p in model.parameters()]
    return max(abs(stats.loss - want_loss) / max(1.0, abs(want_loss)), max_rel_diff(got, want))


def test_unpatched_is_exact():
    assert error_of(tiny_model("llama3"), random_tree(21, 3, 3)) <= 1e-9


def test_a_grandchilds_gkv_dropped_is_caught(monkeypatch):
    """Nodes that read two or more ancestors send gK/gV to their parent only."""
    honest = CachedKeys.__call__

    def parent_only(self, layer, dtype):
        kv = honest(self, layer, dtype)
        if kv is None or len(self.caches) < 2:
            return kv
        cut = sum(c.layers[layer].prefix_k.shape[2] for c in self.caches[:-1])
        return tuple(torch.cat([x[:, :, :cut].detach(), x[:, :, cut:]], dim=2) for x in kv)

    monkeypatch.setattr(CachedKeys, "__call__", parent_only)
    assert error_of(tiny_model("llama3"), random_tree(21, 3, 3)) > 1e-3


def test_a_shared_loss_token_counted_once_is_caught(monkeypatch):
    """A token that several paths train through a shared node is given to the first of them only."""
    honest = TreeRows.__init__

    def once(self, tree):
        honest(self, tree)
        seen = set()
        for entries in self.shared:
            kept = [e for e in entries if (e[0], e[1]) not in seen]
            seen.update((e[0], e[1]) for e in entries)
            entries[:] = kept

    monkeypatch.setattr(TreeRows, "__init__", once)
    assert error_of(tiny_model("llama3"), random_tree(21, 3, 3)) > 1e-3


def test_an_ancestors_positions_restarted_is_caught(monkeypatch):
    """Every internal node's Phase-A forward starts at position 0 instead of after its ancestors."""
    honest = TreeRows._node_row

    def restarted(self, j, rows, targets):
        return dataclasses.replace(honest(self, j, rows, targets), first_position=0)

    monkeypatch.setattr(TreeRows, "_node_row", restarted)
    assert error_of(tiny_model("llama3"), random_tree(21, 3, 3)) > 1e-6
