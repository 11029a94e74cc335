"""Random trees and groups against an independent per-path fp64 reference (issue 36: the red team's 1,000
random trees, made permanent). Masks inside shared nodes, duplicates, prefixes of other paths, forests, both
layouts, both systems, every microbatch mode, ``min_shared_tokens`` 1 / 2 / auto; loss and every gradient
within 1e-9 (max|d| / max|ref| per tensor)."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import tiny_model
from hypothesis import given
from hypothesis import strategies as st
from support.properties import ci, fuzz
from support.reference import max_rel_diff, reference_pg
from support.tree_reference import reference_tree

import prefixflow as pf

TOL = 1e-9
VOCAB = 5


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    """Per tensor ``max|d| <= TOL max|ref|``, with a floor at 1e-12 of the largest gradient entry: a gradient
    that is zero in exact arithmetic (identical tokens: uniform attention, no q/k gradient) is rounding noise."""
    floor = 1e-12 * max(float(w.abs().max()) for w in want)
    return all(
        float((g - w).abs().max()) <= TOL * float(w.abs().max()) + floor
        for g, w in zip(got, want, strict=True)
    )  # a small alphabet: random sequences share prefixes often


@functools.cache
def _model():
    return tiny_model("llama3", dim=32, vocab_size=97)


@st.composite
def tree_inputs(draw):
    """Sequences built from earlier ones (a prefix of one, plus a tail) or fresh (a forest root); loss masks at
    random positions (never a sequence's first token), some inside what becomes a shared node."""
    seqs: list[list[int]] = []
    for _ in range(draw(st.integers(1, 6))):
        if seqs and draw(st.booleans()):
            base = draw(st.sampled_from(seqs))
            head = base[: draw(st.integers(1, len(base)))]
        else:
            head = [draw(st.integers(0, VOCAB - 1))]
        tail = draw(st.lists(st.integers(0, VOCAB - 1), max_size=6))
        seq = head + tail
        if len(seq) < 2:
            seq = seq + [draw(st.integers(0, VOCAB - 1))]
        seqs.append(seq)
    masks = []
    for seq in seqs:
        bits = [False] + draw(st.lists(st.booleans(), min_size=len(seq) - 1, max_size=len(seq) - 1))
        if not any(bits):
            bits[draw(st.integers(1, len(seq) - 1))] = True
        masks.append(torch.tensor(bits))
    adv = draw(st.lists(st.floats(-2, 2, allow_nan=False), min_size=len(seqs), max_size=len(seqs)))
    options = dict(
        system=draw(st.sampled_from(["baseline", "prefixflow"])),
        layout=draw(st.sampled_from(["padded", "packed"])),
        microbatch=draw(st.sampled_from([None, 1, 2, 3])),
    )
    shared = draw(st.sampled_from([1, 2, "auto"]))
    return [torch.tensor(s) for s in seqs], masks, torch.tensor(adv, dtype=torch.float64), shared, options


def _check_tree(case) -> None:
    seqs, masks, adv, shared, options = case
    model = _model()
    tree = pf.build_tree(seqs, adv, masks, min_shared_tokens=shared)
    assert [tree.path_tokens(i).tolist() for i in range(tree.n)] == [s.tolist() for s in seqs]
    want_loss, want = reference_tree(model, tree)
    model.zero_grad(set_to_none=True)
    stats = pf.train_group(model, tree, **options)
    got = [p.grad.detach().clone() for p in model.parameters()]
    assert abs(stats.loss - want_loss) <= TOL * max(1.0, abs(want_loss)), (options, stats.loss, want_loss)
    assert _close(got, want), (options, max_rel_diff(got, want))


@ci(30)
@given(tree_inputs())
def test_random_trees_match_the_per_path_reference(case):
    _check_tree(case)


@fuzz(1000)
@given(tree_inputs())
def test_random_trees_match_the_per_path_reference_fuzz(case):
    _check_tree(case)


@st.composite
def group_inputs(draw):
    prompt = draw(st.lists(st.integers(0, 96), min_size=1, max_size=8))
    responses = draw(st.lists(st.lists(st.integers(0, 96), min_size=1, max_size=6), min_size=1, max_size=5))
    adv = draw(st.lists(st.floats(-2, 2, allow_nan=False), min_size=len(responses), max_size=len(responses)))
    options = dict(
        system=draw(st.sampled_from(["baseline", "prefixflow"])),
        layout=draw(st.sampled_from(["padded", "packed"])),
        microbatch=draw(st.sampled_from([None, 1, 2])),
    )
    return prompt, responses, adv, options


def _check_group(case) -> None:
    prompt, responses, adv, options = case
    model = _model()
    group = pf.RolloutGroup(
        prompt=torch.tensor(prompt),
        responses=[torch.tensor(r) for r in responses],
        advantages=torch.tensor(adv, dtype=torch.float64),
    )
    want_loss, want = reference_pg(model, group)
    model.zero_grad(set_to_none=True)
    stats = pf.train_group(model, group, **options)
    got = [p.grad.detach().clone() for p in model.parameters()]
    assert abs(stats.loss - want_loss) <= TOL * max(1.0, abs(want_loss)), options
    assert _close(got, want), (options, max_rel_diff(got, want))


@ci(20)
@given(group_inputs())
def test_random_groups_match_the_full_sequence_reference(case):
    _check_group(case)


@fuzz(500)
@given(group_inputs())
def test_random_groups_match_the_full_sequence_reference_fuzz(case):
    _check_group(case)


def test_the_fuzz_tests_are_marked():
    marks = {m.name for m in test_random_trees_match_the_per_path_reference_fuzz.pytestmark}
    assert "fuzz" in marks
    with pytest.raises(AttributeError):
        test_random_trees_match_the_per_path_reference.pytestmark  # noqa: B018
