"""`pf-bench rl` before any work: the spec's model built on the meta device, its sequences against the model's
positions (the prompt and ``max_new_tokens`` must fit ``max_seq_len``), and a floor on the memory its runs hold
at once, refused in one line when it exceeds what this process may take (``prefixflow.memory.limit``).

Per run: the actor in fp32 with its gradients and AdamW's two moments (16 bytes a parameter), the rollout
replica and (``kl_coef`` > 0) the reference in the compute dtype; one group's activations. ``lockstep`` holds
every run's models at once, ``sequential`` one run's.
"""

from __future__ import annotations

import os

import torch

from harness.rl.loop import model_overrides, task_of
from harness.rl.spec import RLSpec
from harness.run.memory import MetaShape, check_sequence, meta_shape
from prefixflow.memory.limit import MemoryRefusal, check_fits, gib
from prefixflow.model.dtypes import DTYPES

__all__ = ["rl_need", "check_rl_spec"]

_ACTOR_BYTES = 16  # fp32 weights, gradients, exp_avg, exp_avg_sq
_ACTIVATIONS_PER_TOKEN_LAYER = 2


def rl_need(spec: RLSpec, shape: MetaShape, runs: int) -> int:
    """A floor on the bytes ``runs`` runs of ``spec`` hold at once (see the module doc)."""
    loop = spec.loop
    compute = DTYPES[loop.dtype].itemsize
    replicas = 1 + (loop.kl_coef > 0)
    per_run = shape.n_params * (_ACTOR_BYTES + replicas * compute)
    task = task_of(spec)
    prompt, response = task.prompt_len, _max_response(spec)
    tokens = prompt + loop.n * response  # one group, its prompt once
    activations = tokens * shape.n_layers * shape.hidden * compute * _ACTIVATIONS_PER_TOKEN_LAYER
    logits = loop.n * response * shape.vocab * 4
    return runs * per_run + activations + logits


def _max_response(spec: RLSpec) -> int:
    """The longest response a step can sample: ``max_new_tokens``, or a multi-turn task's two turns and reply."""
    task = task_of(spec)
    longest = getattr(task, "max_response_len", None)
    return longest(spec.loop.max_new_tokens) if longest is not None else spec.loop.max_new_tokens


def check_rl_spec(spec: RLSpec, runs: int, device: torch.device | None, budget: int | None = None) -> None:
    """ValueError naming the field when the loop's sequences exceed the model's ``max_seq_len``;
    :class:`MemoryRefusal` when its floor exceeds what this process may take (``device`` None: the ranks run
    elsewhere, only the sequences are checked)."""
    shape = meta_shape(spec.model.name, model_overrides(spec, task_of(spec)))
    prompt, response = task_of(spec).prompt_len, _max_response(spec)
    what = (
        "loop.max_new_tokens" if response == spec.loop.max_new_tokens else "the longest multi-turn response"
    )
    if prompt >= shape.max_seq_len:
        raise ValueError(
            f"model.overrides.max_seq_len={shape.max_seq_len}: the task's prompt alone is {prompt} tokens; "
            f"set max_seq_len >= {prompt + response} (prompt + {what})"
        )
    try:
        check_sequence(shape, prompt + response, f"the prompt ({prompt}) + {what} ({response})")
    except ValueError as e:
        room = shape.max_seq_len - prompt
        if response != spec.loop.max_new_tokens:  # two policy turns around the tool's reply
            reply = task_of(spec).reply_len
            room = (room - reply) // 2
            if room < 1:  # the reply alone fills the positions: no max_new_tokens fits
                raise ValueError(
                    f"{e}: the prompt ({prompt}) + the tool's reply ({reply}, task.reply_text) leave no room for "
                    f"a policy turn; lower task.reply_text or raise model.overrides.{shape.seq_field}"
                ) from None
        raise ValueError(f"{e} (or lower loop.max_new_tokens to {room} or less)") from None
    if device is None:
        return
    need = rl_need(spec, shape, runs)
    what = (
        f"{spec.name}: {runs} run(s) of {spec.model.name} ({shape.n_params / 1e6:.0f}M parameters, "
        f"schedule {spec.schedule})"
    )
    fix = (
        f"shrink model.overrides (e.g. dim, {shape.layers_field}), use schedule: sequential, "
        "or a larger machine"
    )
    world = spec.parallel.world_size
    nodes = os.environ.get("SLURM_NNODES", "")
    nodes = int(nodes) if nodes.isdigit() and int(nodes) > 0 else 1
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        per_rank = need // world
        if per_rank > free:
            raise MemoryRefusal(
                f"{what} needs at least {gib(per_rank)} per GPU, more than the {gib(free)} free; {fix}"
            )
        return
    check_fits(need // nodes, what, fix, budget)
