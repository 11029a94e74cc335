"""Layouts and traps checked directly: positions, masks, GQA cache shapes, the plain path."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import prefixflow as pf
from prefixflow.attention.modes import NodeAttention
from prefixflow.schedule.caches import CachedKeys
from prefixflow.schedule.stage import forward_hidden
from prefixflow.state.kv_cache import PrefixKVCache
from prefixflow.tree.layouts import lay_out
from prefixflow.tree.plan import TreeRows, group_tree

GROUP = pf.synthetic_group(97, 6, [3, 1, 4], seed=0)
ROWS = TreeRows(group_tree(GROUP))  # one cached node P[:-1] (5 tokens), a leaf [P[-1], S_i] per response


def _layout(rows, layout):
    lens = [ROWS.tree.node_len(j) for j in range(ROWS.tree.n_nodes)]
    return lay_out(rows, ROWS.key_nodes(rows), lens, layout, torch.device("cpu"))


def suffix_microbatch(layout):
    return _layout([ROWS.leaf_rows[i] for i in range(GROUP.n)], layout)


def full_microbatch(layout):
    return _layout([ROWS.full_row(i) for i in range(GROUP.n)], layout)


def capture(cache):
    """Phase A's attention for a prefix with no ancestors: capture every layer's K/V into ``cache``."""
    return NodeAttention(CachedKeys([], []), None, capture=cache)


def test_suffix_inputs_start_with_last_prompt_token_at_its_position():
    for i, resp in enumerate(GROUP.responses):
        row = ROWS.leaf_rows[i]
        assert row.tokens[0] == GROUP.prompt[-1]
        assert torch.equal(row.tokens[1:], resp[:-1])
        assert row.first_position == GROUP.prompt_len - 1


def test_padded_suffix_positions_continue_after_cached_prefix():
    mb = suffix_microbatch("padded")
    assert mb.positions.tolist() == [[5, 6, 7, 8]]
    # Loss positions: each response's tokens, in order, from column 0.
    assert mb.loss_cols.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert mb.targets.tolist() == torch.cat(GROUP.responses).tolist()


def test_packed_positions_restart_at_prefix_length_per_suffix():
    mb = suffix_microbatch("packed")
    assert mb.positions.tolist() == [[5, 6, 7, 5, 5, 6, 7, 8]]
    base = full_microbatch("packed")
    assert base.positions[0, :8].tolist() == list(range(8))  # first [P || S_1] sequence from 0
    assert base.positions[0, 8] == 0  # the next sequence restarts


def test_packed_mask_sees_prefix_own_suffix_causally_never_another_suffix():
    mb = suffix_microbatch("packed")
    mask = mb.mask[0, 0]
    assert mask.shape == (8, 13)
    assert mask[:, :5].all()  # every query sees every cached prefix key
    own = mask[:, 5:]
    segment = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2])
    for q in range(8):
        for k in range(8):
            assert own[q, k] == bool(segment[q] == segment[k] and k <= q)


def test_padded_mask_hides_pads_and_the_future():
    mb = suffix_microbatch("padded")
    own = mb.mask[:, 0, :, 5:]
    lens = [3, 1, 4]
    for b, n in enumerate(lens):
        for q in range(4):
            for k in range(4):
                assert own[b, q, k] == (k <= q and k < n)


def test_baseline_padded_uses_the_plain_causal_path():
    mb = full_microbatch("padded")
    assert mb.mask is None and mb.positions is None
    assert mb.loss_cols[:3].tolist() == [5, 6, 7]  # the last prompt token (index 5) predicts S_1


def test_cache_keeps_kv_heads_and_leaves_are_detached(family):
    model = tiny_model(family)
    cache = PrefixKVCache()
    prefix = GROUP.prompt[:-1].unsqueeze(0)
    with model._prefixflow.state.use(capture(cache)):
        forward_hidden(model, prefix, None, final_norm=False)
    assert len(cache) == 2 and cache.prefix_len == 5
    head_dim = 16
    for entry in cache.layers.values():
        assert entry.live_k.shape == (1, 2, 5, head_dim)  # n_kv_heads, not n_heads: no repeat
        assert entry.live_k.requires_grad and entry.live_k.grad_fn is not None
        assert entry.prefix_k.is_leaf and entry.prefix_k.requires_grad
        assert torch.equal(entry.prefix_k, entry.live_k.detach())
    cache.release()
    assert len(cache) == 0


def test_bf16_model_accumulates_grad_kv_in_fp32():
    model = tiny_model("llama3", dtype=torch.bfloat16)
    assert model._prefixflow.grad_kv_dtype(model) == torch.float32
    cache = PrefixKVCache(torch.float32)
    with model._prefixflow.state.use(capture(cache)):
        forward_hidden(model, GROUP.prompt[:-1].unsqueeze(0), None, final_norm=False)
    entry = cache.layers[0]
    assert entry.live_k.dtype == torch.bfloat16 and entry.prefix_k.dtype == torch.float32
    cache.release()


def test_apply_prefixflow_keeps_plain_forward_bitwise_and_is_idempotent(family):
    from conftest import TINY

    import prefixflow as pf

    name, overrides = TINY[family]
    plain = pf.build_model(name, dtype=torch.float64, overrides=overrides)
    tokens = torch.randint(0, 97, (2, 10))
    before = plain(tokens)
    pf.apply_prefixflow(plain)
    wrapped_once = [m for m in plain.modules() if type(m).__name__ == "PrefixAwareAttention"]
    pf.apply_prefixflow(plain, pf.PrefixFlowConfig(grad_kv_dtype=torch.float64))
    wrapped_twice = [m for m in plain.modules() if type(m).__name__ == "PrefixAwareAttention"]
    assert len(wrapped_once) == len(wrapped_twice) == 2
    assert plain._prefixflow.config.grad_kv_dtype == torch.float64
    assert torch.equal(plain(tokens), before)
    assert plain(tokens).shape == (2, 10, 97)


@pytest.mark.parametrize("ac, expect_calls", [("none", 0), ("full", 1)])
def test_phase_a_skips_the_last_layers_dead_work(family, ac, expect_calls):
    """After the last layer's K/V nothing of the prefix is needed: its MLP never runs in Phase A (unless
    the block is checkpointed, whose recomputation must match its forward)."""
    model = tiny_model(family, ac=ac)
    calls = []
    last = list(model.layers.values())[-1]
    mlp = next(m for name, m in last.named_modules() if name.endswith("feed_forward"))
    mlp.register_forward_hook(lambda *_: calls.append(1))
    seen = {}

    class Probe:
        def enter(self, phase):
            seen[phase] = len(calls)

        def exit(self, phase):
            seen[phase] = len(calls) - seen[phase]

    pf.train_group(model, pf.synthetic_group(97, 12, [3, 2], seed=4), observer=Probe())
    assert seen["A"] == expect_calls
