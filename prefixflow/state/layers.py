"""Recurrent layers under the three phases: the per-layer-type state rule and its phase dispatch.

An attention layer meets the schedule at its SDPA boundary (:class:`~prefixflow.attention.PrefixAwareAttention`).
A recurrent token mixer (gated DeltaNet, Mamba-2) meets it at its own forward: a :class:`StatefulLayer` runs
the layer's :class:`StateRule` under the phase that is running, reading the same attention modes:

- no mode (generation, evaluation): the layer's own forward;
- ``NodeAttention`` (every PrefixFlow phase): each row starts from its parent node's cached end state (its
  leaves; the zero state for a row with no parent); a node's forward in Phase A also keeps its live end state
  in the node's :class:`~prefixflow.state.recurrent.StateCache` (and stops after the last boundary layer
  when the node scores nothing);
- ``MaskedAttention`` (the baseline's packed rows): every sequence starts from the zero state.

In a packed row every segment restarts: where a query may not see the key just before it (the layout's mask),
a new sequence begins. The row is cut into its segments, run as a batch and put back, so no state flows from
one response into the next. A padded batch's rows are its sequences (pads trail, and the layers are causal).

A model family's adapter hands each recurrent layer its rule (:func:`state_rule_for`: the rules registered per
module class, :func:`register_state_rule`). A layer type without a rule is refused by name.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..attention.modes import AttentionState, MaskedAttention, NodeAttention, PrefixCaptured

__all__ = ["StateRule", "StatefulLayer", "register_state_rule", "state_rule_for", "segment_lengths"]


class StateRule:
    """How one recurrent layer type runs from a given boundary state. Subclass it for a layer type.

    ``names``: the state tensors the boundary holds (e.g. ``("recurrent", "conv")``).
    """

    names: tuple[str, ...] = ()

    def run(
        self, module: nn.Module, hidden: torch.Tensor, initial: dict[str, torch.Tensor] | None, kwargs: dict
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The layer's output for ``hidden[n, L, D]``, every row one sequence starting from ``initial``
        (each tensor ``[1, ...]``, to be expanded over the rows; None = the zero state), and the state after
        each row's last token (``{name: [n, ...]}``). ``kwargs``: the layer's other forward arguments."""
        raise NotImplementedError

    def plain(self, module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
        """The layer's own forward (no phase running)."""
        return type(module).forward(module, *args, **kwargs)


_RULES: dict[str, StateRule] = {}


def register_state_rule(module_class: str, rule: StateRule) -> StateRule:
    """Handle recurrent mixers of class name ``module_class`` with ``rule``. Returns the rule."""
    if not isinstance(rule, StateRule):
        raise TypeError(f"rule must be a prefixflow.state.layers.StateRule, got {type(rule).__name__}")
    _RULES[module_class] = rule
    return rule


def state_rule_for(module: nn.Module) -> StateRule | None:
    """The registered rule for ``module``'s class, or None."""
    return _RULES.get(type(module).__name__)


def segment_lengths(mask: torch.Tensor | None, hidden: torch.Tensor) -> list[int] | None:
    """The sequences of a one-row microbatch, from its mask ``[1, 1, L, P_c + L]``: token ``j`` continues token
    ``j - 1`` iff it may attend to it. None: every row is one sequence (no mask, or a padded batch)."""
    if mask is None or hidden.shape[0] != 1:
        return None
    length = hidden.shape[1]
    own = mask[0, 0, :, mask.shape[-1] - length :]
    starts = (~own.diagonal(-1)).nonzero().flatten().add(1).tolist()
    if not starts:
        return None
    bounds = [0, *starts, length]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


class StatefulLayer:
    """One recurrent layer's phase dispatch (held by the layer as a plain attribute; shares the model's
    :class:`~prefixflow.attention.AttentionState`). ``layer``: its index among the model's boundary layers
    (attention and recurrent, in forward order), the index ``NodeAttention.stop_after`` names."""

    def __init__(self, rule: StateRule, layer: int, state: AttentionState, layer_type: str) -> None:
        self.rule, self.layer, self.state, self.layer_type = rule, layer, state, layer_type

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
        mode = self.state.mode
        if mode is None:
            return self.rule.plain(module, args, kwargs)
        hidden, kwargs = _hidden_of(args, kwargs)
        if getattr(mode, "sequence", None) is not None:
            raise ValueError(
                f"a {self.layer_type} layer does not run with its tokens sharded over ranks (context "
                "parallelism) yet"
            )
        initial, capture, mask = None, None, None
        if isinstance(mode, NodeAttention):  # each row starts at its parent node's end state
            parents = [r.ancestors[-1] if r.ancestors else None for r in mode.rows]
            initial, mask = mode.keys.states(self.layer, parents), mode.mask
            if mode.capture is not None:
                capture = mode.capture.states
        elif isinstance(mode, MaskedAttention):
            mask = mode.mask
        else:
            raise ValueError(
                f"a {self.layer_type} layer ({type(module).__name__}) does not run under "
                f"{type(mode).__name__}: recurrent states are carried by PrefixFlow's phases (flat groups and "
                "prefix trees) and the baseline only (not by PrefixGrouper's packed prefix)"
            )
        lengths = _segments(mask, hidden)
        if lengths is None:
            out, final = self.rule.run(module, hidden, initial, kwargs)
        else:
            rows = nn.utils.rnn.pad_sequence(list(hidden[0].split(lengths)), batch_first=True)
            out, final = self.rule.run(module, rows, initial, kwargs)
            out = torch.cat([out[i, :n] for i, n in enumerate(lengths)]).unsqueeze(0)
        if capture is not None:
            capture.capture(self.layer, final)
            if self.layer == mode.stop_after:
                raise PrefixCaptured
        return out


_MEMO: list = [None, None]  # (weak reference to the last mask, its segment lengths): every layer reads it


def _segments(mask, hidden) -> list[int] | None:
    """:func:`segment_lengths`, computed once per microbatch mask (every recurrent layer reads the same)."""
    ref, lengths = _MEMO
    if mask is not None and ref is not None and ref() is mask:
        return lengths
    lengths = segment_lengths(mask, hidden)
    _MEMO[:] = [None if mask is None else weakref.ref(mask), lengths]
    return lengths


def _hidden_of(args: tuple, kwargs: dict) -> tuple[torch.Tensor, dict]:
    """The layer's input hidden states (first positional argument or ``hidden_states``) and its other
    keyword arguments."""
    kwargs = dict(kwargs)
    if args:
        if len(args) > 1:
            raise TypeError("a recurrent layer takes its hidden states positionally, the rest by keyword")
        return args[0], kwargs
    return kwargs.pop("hidden_states"), kwargs
