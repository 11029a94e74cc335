"""Multimodal prefix trees (Qwen2.5-VL): an image in a shared later node (a turn-2 image under a text-only
first turn), and two paths whose token ids agree but whose images differ, which must not share the image.
``build_tree(..., path_inputs=)`` compares images by content; training is exact against each path's full
sequence through the model's own forward (support/vlm.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from support import vlm  # noqa: E402

import prefixflow as pf  # noqa: E402

pytestmark = vlm.VERIFIED_TRANSFORMERS

GRID = (1, 4, 4)


def _sequences():
    gen = torch.Generator().manual_seed(3)
    words = lambda n: torch.randint(3, vlm.IMAGE, (n,), generator=gen)  # noqa: E731
    turn1, a, b, q = words(6), words(3), words(3), words(4)
    block = vlm.image_block(GRID)
    img1, img2 = vlm.pixels(GRID, gen), vlm.pixels(GRID, gen)
    seqs, inputs = [], []
    for image, tail in ((img1, 5), (img1, 7), (None, 4), (img2, 6)):
        body = [turn1, b] if image is None else [turn1, a, block, q]
        seq = torch.cat([*body, words(tail)])
        seqs.append(seq)
        if image is None:
            inputs.append(None)
            continue
        types = (seq == vlm.IMAGE).long().unsqueeze(0)
        inputs.append(
            {"pixel_values": image, "image_grid_thw": torch.tensor([GRID]), "mm_token_type_ids": types}
        )
    prompt_lens = [len(turn1) + len(a) + len(block) + len(q)] * 2 + [len(turn1) + len(b), None]
    prompt_lens[3] = prompt_lens[0]
    masks = [torch.arange(len(s)) >= p for s, p in zip(seqs, prompt_lens, strict=True)]
    return seqs, inputs, masks


def reference(model, tree):
    model.zero_grad(set_to_none=True)
    total = 0.0
    for i in range(tree.n):
        tokens, ts = tree.path_tokens(i), tree.loss_masks[i].nonzero().flatten()
        extra = dict(tree.path_inputs[i] or {})
        if "mm_token_type_ids" in extra:
            extra["mm_token_type_ids"] = extra["mm_token_type_ids"][:, : len(tokens) - 1]
        model.model.rope_deltas = None
        logits = model(input_ids=tokens[:-1].unsqueeze(0), use_cache=False, **extra).logits[0]
        logp = torch.log_softmax(logits.double(), -1)[ts - 1, tokens[ts]]
        loss = -(tree.advantages[i].double() * logp).mean() / tree.n
        loss.backward()
        total += loss.item()
    return total, {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def test_images_share_by_content_and_train_exactly(monkeypatch):
    seqs, inputs, masks = _sequences()
    tree = pf.build_tree(seqs, torch.tensor([1.0, -0.6, 0.4, -0.2]), masks, path_inputs=inputs)
    # paths 0 and 1 share the node with their image; path 3 has the same token ids but another image
    image_nodes = [j for j in range(tree.n_nodes) if bool((tree.segments[j] == vlm.IMAGE).any())]
    shared = [j for j in image_nodes if tree.children[j]]
    assert len(image_nodes) == 2 and len(shared) == 1
    assert sorted(i for i in range(tree.n) if shared[0] in tree.path_nodes(i)) == [0, 1]
    assert tree.parents[shared[0]] >= 0 and tree.first_position[shared[0]] > 0  # a later node, not the root
    text_only = pf.build_tree(seqs, torch.tensor([1.0, -0.6, 0.4, -0.2]), masks)
    assert text_only.n_nodes < tree.n_nodes  # by token ids alone, path 3 would wrongly share path 0's image

    model = vlm.build_qwen("qwen2_5_vl")
    vlm.neutralise_fp32(model, monkeypatch)
    want_loss, want = reference(model, tree)
    pf.apply_prefixflow(model)
    for system, layout, microbatch in (("prefixflow", "padded", None), ("prefixflow", "packed", 1),
                                       ("prefixflow", "padded", 2), ("baseline", "packed", None)):  # fmt: skip
        model.zero_grad(set_to_none=True)
        stats = pf.train_group(model, tree, system=system, layout=layout, microbatch=microbatch)
        assert abs(stats.loss - want_loss) <= 1e-9 * abs(want_loss), (system, layout, microbatch)
        vlm.compare_grads(model, want)
        # PrefixFlow: the shared image once (its node's Phase A), path 3's in its leaf; baseline: once per path
        assert stats.vision_runs == (2 if system == "prefixflow" else 3), system

    # negative control: by token ids alone, path 3 reads path 0's image from the shared node
    with monkeypatch.context() as m:
        m.setattr("prefixflow.tree.build.content_keys", lambda seqs, inputs: None)
        wrong = pf.build_tree(seqs, tree.advantages, masks, path_inputs=inputs)
    model.zero_grad(set_to_none=True)
    pf.train_group(model, wrong)
    with pytest.raises(AssertionError):
        vlm.compare_grads(model, want, tol=1e-6)
