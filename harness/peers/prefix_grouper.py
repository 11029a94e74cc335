"""The PrefixGrouper peer: PyPI ``prefix_grouper`` run on our TorchTitan model through our SDPA boundary.

PrefixGrouper trains a rollout group as *one packed graph* ``[P, S_1', .., S_N']`` (here
``S_i' = S_i[:-1]``, the response tokens that predict a next response token, exactly the baseline's trunk
inputs): the prefix runs once, and in every attention layer PrefixGrouper ungroups q/k/v, attends the
prefix causally, attends each suffix against ``[prefix repeated N times ; own suffix]``, and groups the
outputs back. Everything the two systems do not share with our baseline is PrefixGrouper's own code
(``from_ungrouped_masks``, ``concat_input``, ``AttentionForward`` via ``pg.forward``, ``split_output``):

- attention function: ours, :func:`grouped_attention_func`. The prefix call (``Lq = Lk = P``, no padding) is
  plain causal SDPA (``is_causal``, the kernel skips the upper triangle, as the baseline's does); the suffix
  calls run SDPA under PrefixGrouper's 2-D key-padding mask plus *bottom-right* causal alignment (SDPA's
  ``is_causal`` is top-left when ``Lq != Lk``). Both run under the model's ``sdpa_kernel`` backend list;
- positions: ours, every suffix restarts at ``|P|``;
- loss: ``prefixflow.loss`` on a ``prefixflow.tree.layouts.Microbatch`` loss index over ``split_output(...,
  include_prefix_last=1)``; the LM head runs only at response-predicting positions, as in our baseline.

Installed with the PrefixFlow wrapper mechanism: :class:`GroupedAttention` is a mode on
``model._prefixflow.state`` (``apply_prefixflow`` first), active for the forward *and* backward, so
activation-checkpoint recomputation sees the same attention.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

__all__ = [
    "CAUSAL",
    "GroupedAttention",
    "attention_mask",
    "bottom_right_mask",
    "grouped_attention_func",
    "pack_group",
    "train_group_prefix_grouper",
]


def bottom_right_mask(key_mask: torch.Tensor, lq: int) -> torch.Tensor:
    """bool ``[b, 1, Lq, Lk]``: query ``i`` sees key ``j`` iff ``key_mask[:, j]`` and ``j <= i + (Lk - Lq)``
    (bottom-right causal: the queries are the *last* ``Lq`` positions of the key sequence)."""
    lk = key_mask.shape[-1]
    causal = torch.ones(lq, lk, dtype=torch.bool, device=key_mask.device).tril_(diagonal=lk - lq)
    return causal.view(1, 1, lq, lk) & key_mask.bool().view(key_mask.shape[0], 1, 1, lk)


CAUSAL = "causal"  # a prepared mask entry meaning plain causal attention (Lq == Lk, no padding)


def attention_mask(key_mask: torch.Tensor, lq: int):
    """What one call attends under: :data:`CAUSAL` when the queries are all the keys and none is padding (the
    prefix call), else the bool :func:`bottom_right_mask`."""
    if lq == key_mask.shape[-1] and bool(key_mask.all()):
        return CAUSAL
    return bottom_right_mask(key_mask, lq)


def grouped_attention_func(q, k, v, key_mask, *, scale=None, enable_gqa=False, masks=None, backends=None):
    """PrefixGrouper's ``attn_func``: ``q [b, H, Lq, D]``, ``k/v [b, H_kv, Lk, D]``, ``key_mask`` bool
    ``[b, Lk]`` -> ``[b, Lq, H, D]`` (the layout ``PrefixGrouper.group`` expects), under
    :func:`attention_mask`. ``masks``: optional ``{(Lq, Lk): mask}`` prepared once per group (the same for
    every layer; chosen by shape, so a compiled block reads it without side effects or guards on data).
    ``backends``: the ``sdpa_kernel`` list to run under (the model's own; None = SDPA's default choice).
    """
    lq, lk = q.shape[2], k.shape[2]
    mask = masks.get((lq, lk)) if masks is not None else None
    if mask is None:
        mask = attention_mask(key_mask, lq)
    scope = sdpa_kernel(backends, set_priority=True) if backends else contextlib.nullcontext()
    with scope:
        if isinstance(mask, str):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out.transpose(1, 2)


class GroupedAttention:
    """PrefixFlow attention mode that hands each layer's attention to ``pg.forward``.

    The prefix call attends ``[1, P]`` queries to ``P`` keys (causal), the suffix call ``[N, S_max]`` queries
    to ``P + S_max`` keys; both are prepared here once, from PrefixGrouper's own 2-D masks.
    """

    def __init__(self, pg) -> None:
        self.pg = pg
        prefix, suffix = pg.prefix_attn_mask, pg.suffix_attn_mask
        s_max = suffix.shape[-1] - prefix.shape[-1]
        self.masks = {
            (prefix.shape[-1], prefix.shape[-1]): attention_mask(prefix, prefix.shape[-1]),
            (s_max, suffix.shape[-1]): attention_mask(suffix, s_max),
        }

    def __call__(self, wrapper, q, k, v, *, scale, enable_gqa):
        from prefixflow.attention.modes import sdpa_backends

        out = self.pg.forward(
            grouped_attention_func, q, k, v, scale=scale, enable_gqa=enable_gqa, masks=self.masks,
            backends=sdpa_backends(wrapper),
        )  # fmt: skip
        return out.transpose(1, 2)  # [1, L, H, D] -> [1, H, L, D], what TorchTitan's attention expects back


def pack_group(group, device: torch.device):
    """PrefixGrouper's packed input for one group: ``(pg, tokens [1, L], positions [1, L], loss index)``.

    The loss index is a ``prefixflow.tree.layouts.Microbatch`` over ``split_output(hidden,
    include_prefix_last=1)``: response ``i``'s token ``t`` is predicted at row ``i``, column ``t`` (column 0 is
    the prompt's last token).
    """
    from prefix_grouper import PrefixGrouper

    from prefixflow.tree.layouts import Microbatch

    p, n = group.prompt_len, group.n
    inputs = [r[:-1] for r in group.responses]
    width = max(1, max(int(x.numel()) for x in inputs))
    prefix_ids = group.prompt.view(1, p)
    prefix_mask = torch.ones(1, p, dtype=torch.bool, device=device)
    suffix_ids = torch.zeros(n, width, dtype=torch.long, device=device)
    suffix_mask = torch.zeros(n, width, dtype=torch.bool, device=device)
    for i, x in enumerate(inputs):
        suffix_ids[i, : x.numel()] = x
        suffix_mask[i, : x.numel()] = True
    pg = PrefixGrouper.from_ungrouped_masks(
        prefix_mask, suffix_mask, group_sizes=n, padding_mode="right", device=device
    )
    tokens = pg.concat_input(prefix_ids, prefix_mask, suffix_ids, suffix_mask)
    prefix_pos = torch.arange(p, device=device).view(1, p)
    suffix_pos = (p + torch.arange(width, device=device)).expand(n, width).contiguous()
    positions = pg.concat_input(prefix_pos, prefix_mask, suffix_pos, suffix_mask)
    lens = group.response_lens
    rows = torch.repeat_interleave(torch.arange(n), torch.tensor(lens)).to(device)
    cols = torch.cat([torch.arange(s) for s in lens]).to(device)
    index = Microbatch(
        tokens=tokens,
        positions=positions,
        mask=None,
        loss_rows=rows,
        loss_cols=cols,
        targets=torch.cat(list(group.responses)),
        response_ids=rows,
        token_ids=cols,
    )
    return pg, tokens, positions, index


def train_group_prefix_grouper(model: nn.Module, group, *, loss: str = "pg", loss_config=None, observer=None):
    """Train one rollout group with PrefixGrouper: gradients accumulate into ``param.grad`` (no zeroing).

    Same objective and LM-head placement as ``prefixflow.train_group(system="baseline")``; one phase,
    ``"full"``, reported to ``observer`` and in ``GroupStats.phase_times``. ``GroupStats.prefix_tokens`` is
    ``|P|`` (the prefix runs once, shared in the packed graph); ``trunk_tokens`` is the packed length.
    """
    from prefixflow import GroupStats, RolloutGroup
    from prefixflow.loss import microbatch_loss, resolve_loss, token_logprobs
    from prefixflow.model.adapters import adapter_for
    from prefixflow.model.apply import runtime_of
    from prefixflow.schedule.stage import forward_hidden

    runtime = runtime_of(model)
    if not isinstance(group, RolloutGroup):
        raise TypeError(f"group must be a prefixflow.RolloutGroup, got {type(group).__name__}")
    adapter = adapter_for(model)
    group.check_fits(adapter.vocab_size(model), adapter.max_seq_len(model))
    # The packed row may exceed max_seq_len: RoPE is read at explicit positions, each at most |P| + |S_i|.
    cfg = resolve_loss(loss, loss_config, group)
    device = next(model.parameters()).device
    group = group.to(device)
    if observer is not None:
        observer.enter("full")
    _sync(device)
    start = time.perf_counter()
    try:
        pg, tokens, positions, index = pack_group(group, device)
        with runtime.state.use(GroupedAttention(pg)):
            hidden = forward_hidden(model, tokens, positions)
            _, _, suffix_hidden, _ = pg.split_output(hidden, include_prefix_last=1)
            logits = adapter.lm_head(model)(suffix_hidden[index.loss_rows, index.loss_cols])
            value = microbatch_loss(
                token_logprobs(logits, index.targets, cfg.temperature), index, group, loss, cfg
            )
            value.backward()
        result = value.item()
        _sync(device)
        elapsed = time.perf_counter() - start
    finally:
        if observer is not None:
            observer.exit("full")
    return GroupStats(
        system="prefix_grouper",
        layout="packed",
        loss=result,
        n_microbatches=1,
        prefix_tokens=group.prompt_len,
        suffix_tokens=sum(group.response_lens),
        trunk_tokens=int(tokens.shape[1]),
        phase_times={"full": elapsed},
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
