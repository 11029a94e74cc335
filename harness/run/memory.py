"""Before a cell or an RL run allocates anything: its model built on the meta device (no memory, no init), its
sequences checked against the model's ``max_seq_len``, and a lower bound on the memory it needs (weights, their
gradients, optimizer state, one microbatch's activations and attention masks) refused in one line when it exceeds what this process
may take (``prefixflow.memory.limit``: MemAvailable, ``ulimit -v``, the cgroup, ``$PF_MEMORY_LIMIT``).

The bound is a floor, not a forecast: what it refuses cannot fit; what it passes may still run out (then the
record says ``oom``).
"""

from __future__ import annotations

import copy
import functools
import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from harness.spec.cell import Cell
from prefixflow.memory.limit import MemoryRefusal, check_fits, gib
from prefixflow.model.dtypes import DTYPES
from prefixflow.tree.layouts import mask_bytes

__all__ = [
    "MetaShape",
    "MemoryRefusal",
    "meta_shape",
    "cell_need",
    "masks_need",
    "check_sequence",
    "check_cell_sequences",
    "preflight_cell",
]

HF_PREFIX = "hf:"
_EXACT_LAYERS = 64  # above this many layers, count two small builds and extrapolate (a layer is a layer)
# Per token and layer, the activations a training step keeps are many hidden-sized tensors (norm inputs, q,
# k, v, attention output, MLP inputs and its wider hidden state); 2 is a floor for any block.
_ACTIVATIONS_PER_TOKEN_LAYER = 2


@dataclass(frozen=True)
class MetaShape:
    """What the memory bound and the sequence check need of a model, read from its meta-device build."""

    n_params: int
    hidden: int
    n_layers: int
    vocab: int
    max_seq_len: int
    layers_field: str  # the override that sets n_layers (n_layers, num_hidden_layers)
    seq_field: str  # the override that sets max_seq_len (max_seq_len, max_position_embeddings)


def _extrapolated(count, n_layers: int) -> int:
    """``count(k)``: parameters with k layers. Exact up to _EXACT_LAYERS layers, else linear from 2 and 4."""
    if n_layers <= _EXACT_LAYERS:
        return count(n_layers)
    two, four = count(2), count(4)
    return two + (n_layers - 2) * (four - two) // 2


@functools.lru_cache(maxsize=64)
def _meta_shape(name: str, overrides_json: str) -> MetaShape:
    overrides = json.loads(overrides_json)
    if name.startswith(HF_PREFIX):
        from harness.spec.checks import hf_model_config

        config = hf_model_config(name.removeprefix(HF_PREFIX), overrides)
        text = config.get_text_config()

        def count(k: int) -> int:
            from transformers import AutoModelForCausalLM

            from harness.vlm_models import model_class

            small = copy.deepcopy(config)
            small.get_text_config().num_hidden_layers = k
            if isinstance(getattr(small.get_text_config(), "layer_types", None), list):
                small.get_text_config().layer_types = small.get_text_config().layer_types[:k]
            with torch.device("meta"):
                cls = model_class(small)
                built = cls(small) if cls is not None else AutoModelForCausalLM.from_config(small)
                return sum(p.numel() for p in built.parameters())

        return MetaShape(
            n_params=_extrapolated(count, int(text.num_hidden_layers)),
            hidden=int(text.hidden_size),
            n_layers=int(text.num_hidden_layers),
            vocab=int(text.vocab_size),
            max_seq_len=int(text.max_position_embeddings),
            layers_field="num_hidden_layers",
            seq_field="max_position_embeddings",
        )
    from prefixflow.model.models import count_parameters, resolve_model_args

    args = resolve_model_args(name, overrides)
    return MetaShape(
        n_params=_extrapolated(lambda k: count_parameters(name, {**overrides, "n_layers": k}), args.n_layers),
        hidden=int(args.dim),
        n_layers=int(args.n_layers),
        vocab=int(args.vocab_size),
        max_seq_len=int(args.max_seq_len),
        layers_field="n_layers",
        seq_field="max_seq_len",
    )


def meta_shape(name: str, overrides: dict[str, Any] | None = None) -> MetaShape:
    """The :class:`MetaShape` of ``name`` + ``overrides`` (TorchTitan or ``hf:``); ValueError naming the field
    when they cannot build a model. Nothing is allocated."""
    return _meta_shape(name, json.dumps(dict(overrides or {}), sort_keys=True))


def check_sequence(shape: MetaShape, longest: int, what: str) -> None:
    """ValueError when ``longest`` tokens (a prompt and its longest response) exceed the model's positions."""
    if longest > shape.max_seq_len:
        raise ValueError(
            f"{what} is {longest} tokens, more than the model's {shape.seq_field}={shape.max_seq_len}; "
            f"shorten it or override {shape.seq_field}={longest}"
        )


def check_cell_sequences(cells) -> None:
    """ValueError naming the first measurement or alignment cell whose prompt + response exceed its model's
    positions (a sweep refuses it at load instead of recording the cell's failure)."""
    for cell in cells:
        if cell.frontier is not None:  # a capacity search's lengths are its probes'
            continue
        shape = meta_shape(cell.model.name, cell.model.overrides)
        try:
            check_sequence(
                shape, cell.prefix_len + cell.suffix_len, f"prefix_len + suffix_len ({cell.model.display})"
            )
        except ValueError as e:
            raise ValueError(f"cell {cell.cell_id}: {e}") from None


def _nodes() -> int:
    value = os.environ.get("SLURM_NNODES", "")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def cell_need(cell: Cell, shape: MetaShape) -> int:
    """A floor on the bytes a measurement cell takes on one node: every contender's model copy (weights and
    gradients; the cell holds one per system at once) and one microbatch's activations (the prefix once,
    ``microbatch`` responses; the log-probs at their loss positions in fp32). Sharded ranks hold the copies
    between them; on several nodes each node holds its share."""
    itemsize = DTYPES[cell.dtype].itemsize
    per_mb = cell.n if cell.microbatch is None else 1 if cell.microbatch == "auto" else cell.microbatch
    tokens = cell.prefix_len + per_mb * cell.suffix_len
    models = len(cell.systems) * 2 * shape.n_params * itemsize
    activations = tokens * shape.n_layers * shape.hidden * itemsize * _ACTIVATIONS_PER_TOKEN_LAYER
    logits = per_mb * cell.suffix_len * shape.vocab * 4
    return (models + activations + logits + masks_need(cell, per_mb) + pixels_need(cell)) // _nodes()


def pixels_need(cell: Cell) -> int:
    """A vision cell's pixel inputs (Qwen-VL: ``3 x 2 x 14 x 14`` values per patch, 4 patches per visual token),
    which the tower reads whole; 0 for any other cell."""
    if cell.vision is None:
        return 0
    return cell.vision.visual_tokens * 4 * 3 * 2 * 14 * 14 * DTYPES[cell.dtype].itemsize


def masks_need(cell: Cell, per_mb: int) -> int:
    """The attention masks one microbatch's layout builds (``prefixflow.tree.layouts.mask_bytes``): the
    baseline's full sequences, and PrefixFlow's suffix rows over the cached prefix; the larger, when both run."""
    full = mask_bytes([cell.prefix_len + cell.suffix_len] * per_mb, 0, cell.layout, full_sequences=True)
    suffixes = mask_bytes([cell.suffix_len] * per_mb, cell.prefix_len, cell.layout)
    need = [full if s == "baseline" else suffixes for s in cell.systems]
    return max(need, default=0)


def preflight_cell(cell: Cell, budget: int | None = None) -> None:
    """Refuse, before any model is built or rank started, a measurement cell whose sequences exceed the
    model's positions (ValueError) or whose memory floor exceeds what this process may take
    (:class:`MemoryRefusal`), in one line naming the fix."""
    shape = meta_shape(cell.model.name, cell.model.overrides)
    check_sequence(shape, cell.prefix_len + cell.suffix_len, "--prefix-len + --suffix-len")
    need = cell_need(cell, shape)
    if _device_type(cell.device) == "cuda":
        free, _ = torch.cuda.mem_get_info()
        per_rank = need // max(1, cell.world_size // _nodes())
        if per_rank > free:
            raise MemoryRefusal(
                f"cell {cell.cell_id} ({cell.model.display}, {shape.n_params / 1e6:.0f}M parameters) needs at least "
                f"{gib(per_rank)} per GPU, more than the {gib(free)} free; {_fix(shape)}"
            )
        return
    check_fits(
        need,
        f"cell {cell.cell_id} ({cell.model.display}, {shape.n_params / 1e6:.0f}M parameters, "
        f"{len(cell.systems)} model copies in {cell.dtype})",
        _fix(shape),
        budget,
    )


def _fix(shape: MetaShape) -> str:
    return (
        f"shrink the model (--override, e.g. {shape.layers_field}=2), run fewer --systems, a smaller "
        "--microbatch, or a larger machine"
    )


def _device_type(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name).type
