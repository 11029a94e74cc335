"""KV-cached sampling of N responses to one prompt (the rollout engine of a colocated GRPO loop).

The prompt is prefilled once (batch 1); its K/V are copied into each of the N rows of a preallocated
per-layer cache, and the N responses are then decoded together, one token per step, each step attending to
``cache[:, :, :len]``. Sampling is Gumbel-max on ``logits / temperature`` with noise drawn from the caller's
``torch.Generator``: the noise never depends on the logits, so two models fed the same generator state
draw the same noise, and a sample changes only where the logits change the argmax.

The cache is an attention mode of :func:`prefixflow.apply_prefixflow`'s SDPA wrapper, so generation runs
the same TorchTitan modules (RoPE, qk-norm, GQA) as training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..model.apply import runtime_of
from ..model.models import model_args
from ..schedule.stage import forward_hidden

__all__ = ["DecodeCache", "Rollout", "sample_responses"]


class DecodeCache:
    """Attention mode: append each call's K/V to a per-layer ``[B, H_kv, max_len, D]`` cache and attend
    to everything cached so far. A batch-1 call (the prompt prefill) fills every row of the cache."""

    def __init__(self, batch: int, max_len: int) -> None:
        self.batch, self.max_len = batch, max_len
        self.length = 0  # positions filled by completed forward calls
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def advance(self, n: int) -> None:
        self.length += n

    def __call__(self, wrapper, q, k, v, *, scale, enable_gqa):
        layer, new = wrapper.layer, k.shape[2]
        start, end = self.length, self.length + new
        if end > self.max_len:
            raise RuntimeError(f"decode cache full: {end} positions > max_len {self.max_len}")
        if layer not in self.k:
            shape = (self.batch, k.shape[1], self.max_len, k.shape[3])
            self.k[layer] = k.new_empty(shape)
            self.v[layer] = v.new_empty(shape)
        self.k[layer][:, :, start:end] = k  # a batch-1 prefill broadcasts over the rows
        self.v[layer][:, :, start:end] = v
        keys, values = self.k[layer][: q.shape[0], :, :end], self.v[layer][: q.shape[0], :, :end]
        # new queries see every earlier position and their own block causally (prefill: plain causal)
        mask = None
        if new > 1:
            rows = torch.arange(new, device=q.device).view(-1, 1) + start
            mask = rows >= torch.arange(end, device=q.device).view(1, -1)
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )


@dataclass
class Rollout:
    """N sampled responses to one prompt. ``responses[i]`` ends with ``eos_id`` unless it hit
    ``max_new_tokens``; ``logprobs[i]`` are the sampler's per-token log-probs at temperature 1."""

    responses: list[torch.Tensor]
    logprobs: list[torch.Tensor]
    truncated: list[bool]


def _check(model: nn.Module, prompt: torch.Tensor, n: int, max_new_tokens: int, temperature: float) -> None:
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 1 or prompt.numel() == 0:
        raise ValueError("prompt must be a non-empty 1-D LongTensor of token ids")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1 (responses per prompt), got {n!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
    args = model_args(model)
    if prompt.numel() + max_new_tokens > args.max_seq_len:
        raise ValueError(
            f"prompt ({prompt.numel()}) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"max_seq_len={args.max_seq_len}"
        )
    if int(prompt.max()) >= args.vocab_size or int(prompt.min()) < 0:
        raise ValueError(f"prompt has token ids outside the vocabulary [0, {args.vocab_size})")


@torch.no_grad()
def sample_responses(
    model: nn.Module,
    prompt: torch.Tensor,
    n: int,
    *,
    max_new_tokens: int,
    eos_id: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> Rollout:
    """Sample ``n`` responses to ``prompt`` from ``model`` (``apply_prefixflow`` applied) with a KV cache.

    ``temperature=0`` is greedy. Decoding stops when every response has produced ``eos_id`` or after
    ``max_new_tokens``. The same model weights, prompt and generator state give the same responses.
    """
    _check(model, prompt, n, max_new_tokens, temperature)
    runtime = runtime_of(model)
    device = next(model.parameters()).device
    prompt = prompt.to(device).long()
    cache = DecodeCache(n, prompt.numel() + max_new_tokens)
    tokens = torch.empty(n, max_new_tokens, dtype=torch.long, device=device)
    logps = torch.empty(n, max_new_tokens, dtype=torch.float32, device=device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    ends = torch.full((n,), max_new_tokens, dtype=torch.long, device=device)
    with runtime.state.use(cache):
        hidden = forward_hidden(model, prompt.unsqueeze(0), None)[:, -1]
        cache.advance(prompt.numel())
        for t in range(max_new_tokens):
            logits = model.output(hidden).float().expand(n, -1)
            log_probs = torch.log_softmax(logits, dim=-1)
            if temperature == 0:
                choice = logits.argmax(dim=-1)
            else:
                u = torch.rand(logits.shape, generator=generator, device=device)
                choice = (logits / temperature - torch.log(-torch.log(u))).argmax(dim=-1)
            tokens[:, t] = choice
            logps[:, t] = log_probs.gather(-1, choice.unsqueeze(-1)).squeeze(-1)
            finished = (choice == eos_id) & ~done
            ends[finished] = t + 1
            done |= finished
            if bool(done.all()) or t + 1 == max_new_tokens:
                break
            positions = torch.full((n, 1), cache.length, dtype=torch.long, device=device)
            hidden = forward_hidden(model, tokens[:, t : t + 1], positions)[:, -1]
            cache.advance(1)
    lens = ends.tolist()
    return Rollout(
        responses=[tokens[i, : lens[i]].clone() for i in range(n)],
        logprobs=[logps[i, : lens[i]].clone() for i in range(n)],
        truncated=[not bool(d) for d in done.tolist()],
    )
