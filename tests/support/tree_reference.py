"""Independent per-path references for prefix trees, and random trees, for the tree exactness tests.

The reference runs one plain ``model(tokens)`` per path and writes the issue's objective out by hand: no
prefixflow layout, loss or schedule code is involved.
"""

from __future__ import annotations

import torch

import prefixflow as pf


def reference_tree(
    model, tree, loss: str = "pg", cfg: dict | None = None
) -> tuple[float, list[torch.Tensor]]:
    """The tree objective, path by path: ``pg`` = ``-(1/N) sum_i A_i mean_{t in M_i} log pi(x_it | x_i<t)``;
    ``grpo`` = PPO-clip (token or sequence ratios) + beta * k3 KL, aggregated ``seq-mean-token-mean``.
    Returns the loss and every parameter's gradient (grads zeroed first)."""
    cfg = cfg or {}
    eps_lo, eps_hi = cfg.get("clip_eps_low", 0.2), cfg.get("clip_eps_high", 0.2)
    beta, seq_is = cfg.get("kl_coef", 0.0), cfg.get("importance_sampling", "token") == "sequence"
    model.zero_grad(set_to_none=True)
    total = 0.0
    for i in range(tree.n):
        tokens = tree.path_tokens(i)
        mask = tree.loss_masks[i]
        ts = mask.nonzero().flatten()
        logits = model(tokens[:-1].unsqueeze(0))[0]
        logp = torch.log_softmax(logits.double(), dim=-1)[ts - 1, tokens[ts]]
        adv = tree.advantages[i].double()
        if loss == "pg":
            path_loss = -(adv * logp).mean()
        else:
            old = logp.detach() if tree.old_logprobs is None else tree.old_logprobs[i][ts].double()
            log_ratio = logp - old
            if seq_is:
                log_ratio = log_ratio.mean().expand_as(logp)
            ratio = torch.exp(log_ratio)
            token = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - eps_lo, 1 + eps_hi) * adv)
            if beta > 0:
                delta = tree.ref_logprobs[i][ts].double() - logp
                token = token + beta * (torch.exp(delta) - delta - 1)
            path_loss = token.mean()
        path_loss = path_loss / tree.n
        path_loss.backward()
        total += path_loss.item()
    return total, [p.grad.detach().clone() for p in model.parameters()]


def random_sequences(seed: int, depth: int, branching: int, vocab: int = 97, end_inside: bool = True):
    """Root-to-leaf token sequences of a random tree: ``depth`` levels below the root, 1..``branching``
    children per node (at least one node branches ``branching`` times), segments of 1-4 tokens; with
    ``end_inside`` one more sequence ends inside an internal node (a prefix of another)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    def seg():
        return torch.randint(0, vocab, (rand(1, 4),), generator=gen)

    sequences = []
    frontier = [(seg(), 0)]
    first = True
    while frontier:
        prefix, level = frontier.pop()
        if level == depth:
            sequences.append(prefix)
            continue
        k = branching if first else rand(1, branching)
        first = False
        frontier += [(torch.cat([prefix, seg()]), level + 1) for _ in range(k)]
    if end_inside and depth > 1:
        longest = max(sequences, key=len)
        sequences.append(longest[: max(2, len(longest) - 3)].clone())
    return sequences


def random_tree(
    seed: int, depth: int, branching: int, *, grpo: bool = False, min_shared_tokens: int = 1, vocab: int = 97
):
    """A tree of :func:`random_sequences` with random loss masks (never the first token, at least one trained
    token per path, shared tokens trained too) and, with ``grpo``, old/ref log-probs."""
    seqs = random_sequences(seed, depth, branching, vocab)
    gen = torch.Generator().manual_seed(1000 + seed)
    masks = []
    for s in seqs:
        m = torch.rand(len(s), generator=gen) < 0.7
        m[0] = False
        m[-1] = True
        masks.append(m)
    adv = torch.randn(len(seqs), generator=gen, dtype=torch.float64)
    old = ref = None
    if grpo:
        old = [-4.5 + 0.3 * torch.randn(len(s), generator=gen, dtype=torch.float64) for s in seqs]
        ref = [-4.5 + 0.3 * torch.randn(len(s), generator=gen, dtype=torch.float64) for s in seqs]
    return pf.build_tree(
        seqs, adv, masks, old_logprobs=old, ref_logprobs=ref, min_shared_tokens=min_shared_tokens
    )


def depth_of(tree) -> int:
    return max(len(tree.path_nodes(i)) for i in range(tree.n)) - 1
