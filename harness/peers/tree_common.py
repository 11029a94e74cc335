"""What the tree peers (``tree_mask``, ``dfs_relay``) share: input checks on a ``prefixflow.RolloutTree``,
the LM head at scored rows only, and each path's loss through ``prefixflow.loss`` (the library's objective,
never a copy): ``microbatch_loss`` over ``RolloutTree.path_losses()`` with one loss entry per
``(path, slot)``, so a token shared by k paths counts k times with each path's own weight."""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

__all__ = ["TreeInput", "prepare_tree", "path_loss", "masked_sdpa", "timed"]


class TreeInput:
    """A checked tree on the model's device with its loss data and config."""

    def __init__(self, model, tree, loss: str, loss_config) -> None:
        from prefixflow import RolloutTree
        from prefixflow.loss import resolve_loss
        from prefixflow.model.adapters import adapter_for
        from prefixflow.model.apply import runtime_of
        from prefixflow.tree.plan import TreeRows

        if not isinstance(tree, RolloutTree):
            raise TypeError(f"tree must be a prefixflow.RolloutTree, got {type(tree).__name__}")
        self.runtime = runtime_of(model)
        self.adapter = adapter_for(model)
        tree.check_fits(self.adapter.vocab_size(model), self.adapter.max_seq_len(model))
        self.device = next(model.parameters()).device
        self.tree = tree.to(self.device)
        self.losses = self.tree.path_losses()
        self.loss = loss
        self.cfg = resolve_loss(loss, loss_config, self.losses)
        self.plan = TreeRows(self.tree)  # where each (path, slot) is scored: the library's own map
        self.model = model

    def logprobs(self, hidden_rows: torch.Tensor, targets: list[int]) -> torch.Tensor:
        """log pi(target) at ``hidden_rows`` ([T, dim]): the model's LM head at those rows only."""
        from prefixflow.loss import token_logprobs

        logits = self.adapter.lm_head(self.model)(hidden_rows)
        t = torch.tensor(targets, dtype=torch.long, device=self.device)
        return token_logprobs(logits, t, self.cfg.temperature)


def prepare_tree(model, tree, loss: str = "pg", loss_config=None) -> TreeInput:
    return TreeInput(model, tree, loss, loss_config)


def path_loss(inp: TreeInput, logp: torch.Tensor, paths: list[int], slots: list[int]) -> torch.Tensor:
    """The group objective's share of the loss entries ``(paths[t], slots[t])`` with log-probs ``logp[t]``."""
    from prefixflow.loss import microbatch_loss
    from prefixflow.tree.layouts import Microbatch

    long = dict(dtype=torch.long, device=inp.device)
    empty = torch.zeros(0, **long)
    mb = Microbatch(
        tokens=empty.view(1, 0), positions=None, mask=None, loss_rows=empty, loss_cols=empty, targets=empty,
        response_ids=torch.tensor(paths, **long), token_ids=torch.tensor(slots, **long),
    )  # fmt: skip
    return microbatch_loss(logp, mb, inp.losses, inp.loss, inp.cfg)


def masked_sdpa(wrapper, q, k, v, mask, scale, enable_gqa):
    """SDPA under ``mask`` restricted to the model's own backend list (the kernels its causal call may run)."""
    from prefixflow.attention.modes import sdpa_backends

    backends = sdpa_backends(wrapper)
    scope = sdpa_kernel(backends, set_priority=True) if backends else contextlib.nullcontext()
    with scope:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


@contextlib.contextmanager
def timed(device: torch.device, observer, phase: str, times: dict[str, float]):
    """``observer.enter/exit(phase)`` around the block, its seconds added to ``times[phase]``."""
    if observer is not None:
        observer.enter(phase)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    try:
        yield
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times[phase] = times.get(phase, 0.0) + time.perf_counter() - start
        if observer is not None:
            observer.exit(phase)
