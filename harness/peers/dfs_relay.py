"""The ``dfs_relay`` peer (the AReaL-DTA design, PR #1391): one root-to-leaf path at a time, depth first.

Each internal node is forwarded twice: first without gradients when the walk enters it (its K/V per layer and
the log-probs it scores are kept, detached, for its descendants), then again with gradients when its whole
subtree is done, seeded by the K/V gradients its descendants accumulated in a dK/dV buffer and by the
log-prob gradients of every path that read its scores. A leaf runs once, with gradients, as a batch of one
reading its ancestors' stored K/V through leaves that require grad; after each backward those leaves'
gradients are added to the ancestors' buffers. Siblings are never batched. The loss is ``prefixflow.loss``
per ``(path, slot)`` (:mod:`harness.peers.tree_common`); positions continue through the ancestors.
"""

from __future__ import annotations

import torch

from .tree_common import masked_sdpa, path_loss, prepare_tree, timed

__all__ = ["RelayAttention", "train_dfs_relay"]


class RelayAttention:
    """Attention mode for one node's row: keys = ``read(layer)`` (its ancestors' K/V, or None) then its own,
    causal over its own; ``capture``: a dict that receives this forward's K/V per layer."""

    def __init__(self, read, capture: dict | None = None) -> None:
        self.read, self.capture = read, capture

    def __call__(self, wrapper, q, k, v, *, scale, enable_gqa):
        if self.capture is not None:
            self.capture[wrapper.layer] = (k, v)
        cached = self.read(wrapper.layer)
        if cached is None:
            return wrapper.inner(q, k, v, scale=scale, enable_gqa=enable_gqa, is_causal=True)
        n_keys, n = cached[0].shape[2], q.shape[2]
        keys = torch.cat([cached[0], k], dim=2)
        values = torch.cat([cached[1], v], dim=2)
        own = torch.ones(n, n, dtype=torch.bool, device=q.device).tril_()
        mask = torch.cat([torch.ones(n, n_keys, dtype=torch.bool, device=q.device), own], dim=1)
        return masked_sdpa(wrapper, q, keys, values, mask, scale, enable_gqa)


class _Relay:
    def __init__(self, inp) -> None:
        self.inp = inp
        self.kv: dict[int, dict[int, tuple]] = {}  # node -> layer -> (K, V), detached (no-grad pass)
        self.dkv: dict[int, dict[int, list]] = {}  # node -> layer -> [dK, dV] accumulated by descendants
        self.logp: dict[int, torch.Tensor] = {}  # node -> its scores' log-probs (detached, requires grad)
        self.trunk = 0
        self.forwards = 0

    def forward(self, j: int, read, capture=None):
        from prefixflow.schedule.stage import forward_hidden

        tree = self.inp.tree
        tokens = tree.segments[j].view(1, -1)
        positions = (tree.first_position[j] + torch.arange(tokens.shape[1], device=tokens.device)).view(1, -1)
        self.trunk += int(tokens.numel())
        self.forwards += 1
        with self.inp.runtime.state.use(RelayAttention(read, capture)):
            return forward_hidden(self.inp.model, tokens, positions)

    def stored(self, ancestors: list[int]):
        def read(layer: int):
            if not ancestors:
                return None
            parts = [self.kv[a][layer] for a in ancestors]
            return torch.cat([k for k, _ in parts], dim=2), torch.cat([v for _, v in parts], dim=2)

        return read

    def leaves(self, ancestors: list[int], made: list):
        def read(layer: int):
            if not ancestors:
                return None
            ks, vs = [], []
            for a in ancestors:
                k, v = (t.detach().requires_grad_(True) for t in self.kv[a][layer])
                made.append((a, layer, k, v))
                ks.append(k)
                vs.append(v)
            return torch.cat(ks, dim=2), torch.cat(vs, dim=2)

        return read

    def deposit(self, made: list) -> None:
        for a, layer, k, v in made:
            acc = self.dkv.setdefault(a, {}).setdefault(layer, [None, None])
            for s, g in enumerate((k.grad, v.grad)):
                if g is not None:
                    acc[s] = g if acc[s] is None else acc[s] + g

    def shared_entries(self, paths: list[int]):
        """The ancestor-scored log-prob leaves of ``paths`` as (logp list, path ids, slots)."""
        plan = self.inp.plan
        logps, ids, slots = [], [], []
        for i in paths:
            for node, k, slot in plan.shared[i]:
                logps.append(self.logp[node][k : k + 1])
                ids.append(i)
                slots.append(slot)
        return logps, ids, slots

    def visit(self, j: int) -> float:
        inp, tree, plan = self.inp, self.inp.tree, self.inp.plan
        ancestors = tree.ancestors(j)
        internal = bool(tree.children[j])
        ending = [i for i in range(tree.n) if tree.path_ends[i] == j]
        total = 0.0
        scorer = plan.node_rows.get(j)
        rows, targets = ([], []) if scorer is None else (scorer.cols.tolist(), scorer.targets.tolist())
        if internal:
            self.kv[j] = {}
            with torch.no_grad():
                hidden = self.forward(j, self.stored(ancestors), capture=self.kv[j])
                if rows:
                    self.logp[j] = inp.logprobs(hidden[0, rows], targets)
            if rows:
                self.logp[j].requires_grad_(True)
            for c in tree.children[j]:
                total += self.visit(c)
        made: list = []
        live: dict[int, tuple] = {}
        hidden = self.forward(j, self.leaves(ancestors, made), capture=live if internal else None)
        roots, grads = [], []
        own, own_ids, own_slots = [], [], []
        if internal:
            for layer, (k, v) in live.items():
                acc = self.dkv.get(j, {}).get(layer, [None, None])
                for t, g in zip((k, v), acc, strict=True):
                    if g is not None:
                        roots.append(t)
                        grads.append(g)
        else:  # the leaf scores its own tokens for the paths ending here
            for i in ending:
                if (row := plan.leaf_rows.get(i)) is not None:
                    own.append(inp.logprobs(hidden[0, row.cols], row.targets.tolist()))
                    own_ids += [i] * len(row.cols)
                    own_slots += row.slots.tolist()
        if ending:  # these paths' losses: their own scores and the leaves of the scores above them
            shared, ids, slots = self.shared_entries(ending)
            value = path_loss(inp, torch.cat(own + shared), own_ids + ids, own_slots + slots)
            total += value.item()
            roots.append(value)
            grads.append(None)
        if internal and rows:
            # every path below j (and ending at j) has read j's scores by now: seed the live log-probs
            leaf = self.logp[j]
            live_logp = inp.logprobs(hidden[0, rows], targets)
            if ending:  # the losses of paths ending here read j's leaf: run them first
                torch.autograd.backward(roots[-1:])
                roots, grads = roots[:-1], grads[:-1]
            if leaf.grad is not None:
                roots.append(live_logp)
                grads.append(leaf.grad)
        if roots:
            torch.autograd.backward(
                roots, [torch.ones_like(r) if g is None else g for r, g in zip(roots, grads, strict=True)]
            )
        self.deposit(made)
        self.kv.pop(j, None)
        self.dkv.pop(j, None)
        self.logp.pop(j, None)
        return total


def train_dfs_relay(model, tree, *, loss: str = "pg", loss_config=None, observer=None):
    """Train ``tree`` with the DFS relay: gradients accumulate into ``param.grad`` (no zeroing).

    Returns ``prefixflow.GroupStats`` (``trunk_tokens``: every node forward's tokens, twice for internal nodes;
    one phase ``full``)."""
    from prefixflow import GroupStats

    inp = prepare_tree(model, tree, loss, loss_config)
    relay = _Relay(inp)
    times: dict[str, float] = {}
    total = 0.0
    with timed(inp.device, observer, "full", times):
        for root in [j for j in inp.tree.order if inp.tree.parents[j] < 0]:
            total += relay.visit(root)
    return GroupStats(
        system="dfs_relay", layout="padded", loss=total, n_microbatches=relay.forwards, prefix_tokens=0,
        suffix_tokens=sum(int(m.sum()) for m in inp.tree.loss_masks), trunk_tokens=relay.trunk,
        phase_times=times,
    )  # fmt: skip
