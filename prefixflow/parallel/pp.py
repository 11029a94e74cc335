"""Pipeline parallelism (paper §4.6): PrefixFlow's phases run per stage, switched stage-locally.

The model is cut into stages with TorchTitan's ``pipeline_module_split`` (``apply_pp``). Each stage runs a
program of operations; activations and their gradients travel between neighbouring stages by P2P send/recv:

- ``A``: the prefix forward on this stage (capture mode). It starts as soon as the previous stage's prefix
  output arrives, and sends this stage's prefix output on.
- ``F m`` / ``B m``: the forward / backward of microbatch ``m`` in 1F1B order (``pp - stage - 1`` warm-up
  forwards, then one forward one backward, then the cool-down backwards). Suffix microbatches for PrefixFlow,
  ``[P || S_i]`` microbatches for the baseline; both use the same stage code.
- ``C``: the delayed prefix backward of this stage, seeded with its accumulated gK/gV and the gradient of its
  prefix output that the next stage's ``C`` sent back; it sends the gradient of its prefix input on. So the
  prefix backward runs in reverse stage order, each stage right after its own last suffix backward.

``switching="stage_local"`` is exactly that program. ``switching="barrier"`` adds global barriers after ``A``
and before ``C`` (A | B | C): the pipeline drains after the prefix forward and refills around the prefix
backward. Both run the same operations on the same data; only the waiting differs. :func:`stage_program` is
the one definition of both orders (``pp_program.py``; the simulator in ``harness/`` replays it). The stage
runtime that executes it, ``pp_stage.Pipeline``, is the model's :class:`~prefixflow.schedule.stage.Stage`: the one driver
(``train_group``) runs its phases on it, with the same guard, hooks and loss as on one device.

Why not ``torch.distributed.pipelining``'s schedules: they run one stage function over equal-shaped chunks of
one batch and seed every backward with the stage output's gradient alone. PrefixFlow's prefix is another
computation (capture mode, ``[1, P-1]`` tokens), its backward is seeded by gK/gV accumulated inside the stage
and must wait for that stage's last suffix backward, and padded widths, packed lengths and CP shards differ
per microbatch. So the stage program is written here over ``torch.distributed`` P2P (gloo and NCCL), with a
small shape header before each tensor; the split itself is TorchTitan's.
"""

from __future__ import annotations

import contextlib

from torch import nn

from ..model.adapters import adapter_for
from ..model.models import model_args
from ..runtime import runtime_of
from .pp_program import SWITCHING, stage_program
from .pp_stage import Pipeline

__all__ = ["SWITCHING", "Pipeline", "apply_pp", "stage_program", "switching"]


def apply_pp(
    model: nn.Module,
    pp_mesh,
    *,
    switching: str = "stage_local",
    input_weight: int = 1,
    output_weight: int = 1,
) -> nn.Module:
    """Cut ``model`` into ``pp_mesh.size()`` stages with TorchTitan's ``pipeline_module_split`` and return this
    rank's stage (``pp_mesh``: a DeviceMesh with a ``pp`` dimension, e.g. ``world_mesh["pp"]``).

    TorchTitan's order: PP first, then TP/AC/compile/FSDP. It may come before or after ``apply_prefixflow``
    (a wrapped model's stage renumbers its attention layers from 0). ``train_group`` on the returned stage runs
    the pipelined schedule (the stage is the runtime's :class:`~prefixflow.schedule.stage.Stage`). ``switching``: ``"stage_local"`` or
    ``"barrier"`` (changeable later through ``runtime_of(model).stage.switching``)."""
    from torchtitan.distributed.pipeline_parallel import (
        generate_llm_fqn_per_model_part,
        pipeline_module_split,
    )

    if switching not in SWITCHING:
        raise ValueError(f"switching {switching!r} unknown; valid: {SWITCHING}")
    adapter = adapter_for(model)
    if adapter.name != "torchtitan":
        raise ValueError(
            f"pipeline parallelism cuts TorchTitan models with TorchTitan's split; {type(model).__name__} is a "
            f"{adapter.name} model: train it without pp, or build the TorchTitan flavour of its architecture"
        )
    tok, out = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    if tok is not None and out is not None and out.weight is tok.weight:
        raise ValueError(
            "pipeline parallelism cannot split tied input/output embeddings across stages; "
            "build the model with overrides={'enable_weight_tying': False}"
        )
    n_layers = len(model.layers)
    names = generate_llm_fqn_per_model_part(pp_mesh.size(), n_layers, input_weight, output_weight)
    device = next(model.parameters()).device
    stages, models = pipeline_module_split(model, pp_mesh, "1F1B", device, names)
    stage = models[0]
    pipe = Pipeline(
        stage=stages[0].stage_index,
        n_stages=stages[0].num_stages,
        process_group=pp_mesh.get_group(),
        switching=switching,
        hidden=model_args(model).dim,
    )
    runtime = runtime_of(stage, create=True)  # the split copies the model, and its runtime with it
    if runtime.config is not None:
        _renumber_attention(stage)
    runtime.stage = pipe
    runtime.name = runtime_of(model, create=True).name
    return stage


def _renumber_attention(stage: nn.Module) -> None:
    """A stage cut from a PrefixFlow-wrapped model: its wrappers get a state of their own, numbered 0.. in
    layer order (the cache's layer keys are per stage)."""
    from ..attention.modes import AttentionState, PrefixAwareAttention

    runtime = runtime_of(stage)
    state = AttentionState()
    for i, wrapper in enumerate(m for m in stage.modules() if isinstance(m, PrefixAwareAttention)):
        wrapper.layer, wrapper.state = i, state
        state.wrappers.append(wrapper)
    runtime.state, runtime.n_wrapped = state, len(state.wrappers)


@contextlib.contextmanager
def switching(model: nn.Module, value: str):
    """Run with another phase switching for a while (e.g. to compare ``barrier`` with ``stage_local``)."""
    pipe = runtime_of(model, create=True).stage
    if pipe is None:
        raise ValueError("this model is not a pipeline stage (apply_pp / parallelize with pp > 1 first)")
    if value not in SWITCHING:
        raise ValueError(f"switching {value!r} unknown; valid: {SWITCHING}")
    old, pipe.switching = pipe.switching, value
    try:
        yield
    finally:
        pipe.switching = old
