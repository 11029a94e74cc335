"""GRPO building blocks on PrefixFlow models: KV-cached sampling, advantages, evaluation, actor update, sync.

>>> rollout = sample_responses(rollout_model, prompt, 8, max_new_tokens=16, eos_id=2, generator=gen)
>>> old = response_logprobs(actor, prompt, rollout.responses)
>>> group = RolloutGroup(prompt, rollout.responses, group_advantages(rewards), old)
>>> stats = actor_update(actor, [group], optimizer, system="prefixflow")
>>> sync_weights(actor, rollout_model)
"""

from .generate import DecodeCache, Rollout, sample_responses
from .grpo import (
    UpdateStats,
    actor_update,
    autocast_for,
    group_advantages,
    named_parameters,
    response_logprobs,
    sync_weights,
)

__all__ = [
    "DecodeCache",
    "Rollout",
    "UpdateStats",
    "actor_update",
    "autocast_for",
    "group_advantages",
    "named_parameters",
    "response_logprobs",
    "sample_responses",
    "sync_weights",
]
