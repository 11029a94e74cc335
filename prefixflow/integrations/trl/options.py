"""The trainer's own options, checked before TRL builds anything (one ``ValueError`` naming the option)."""

from __future__ import annotations

import math

from torch import nn

from ...memory.budget import AUTO
from ...runtime import runtime_of
from .plan import check_min_shared_tokens

__all__ = ["check_options", "min_shared_tokens_for"]


def check_options(layout, microbatch, tree, min_shared_tokens, verify_tolerance) -> None:
    """The PrefixFlow options, refused before TRL builds anything (one line naming the option)."""
    if layout not in ("padded", "packed"):
        raise ValueError(f"prefixflow_layout must be 'padded' or 'packed', got {layout!r}")
    if tree not in (True, False, "auto") or isinstance(tree, int) and not isinstance(tree, bool):
        raise ValueError(f"prefixflow_tree must be True, False or 'auto', got {tree!r}")
    if (
        microbatch is not None
        and microbatch != AUTO
        and (isinstance(microbatch, bool) or not isinstance(microbatch, int) or microbatch < 1)
    ):
        raise ValueError(
            f"prefixflow_microbatch must be None (all completions), an int >= 1 or 'auto', got {microbatch!r}"
        )
    if min_shared_tokens is not None:
        check_min_shared_tokens(min_shared_tokens)
    if verify_tolerance is not None and (
        isinstance(verify_tolerance, bool)
        or not isinstance(verify_tolerance, (int, float))
        or not (math.isfinite(verify_tolerance) and verify_tolerance > 0)
    ):
        raise ValueError(
            f"verify_tolerance must be a finite number > 0 (or None: by dtype), got {verify_tolerance!r}"
        )


def min_shared_tokens_for(model: nn.Module, requested: int | str | None) -> int | str:
    """Trees' ``min_shared_tokens``: 1, or 2 on a model with recurrent layers (a state layer cannot continue
    from a one-token node's end state yet); a smaller request there is refused."""
    if not runtime_of(model).state.state_layers:
        return 1 if requested is None else requested
    if requested is None:
        return 2
    if requested == "auto" or requested < 2:
        raise ValueError(
            f"prefixflow_min_shared_tokens={requested!r}: this model has recurrent layers, whose trees need "
            "shared nodes of at least 2 tokens; pass an int >= 2 (or None: 2)"
        )
    return requested
