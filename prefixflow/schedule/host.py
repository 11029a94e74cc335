"""Host reads of values under an estimate (``torch._subclasses.fake_tensor.FakeTensorMode``).

A call run under fake tensors (``pf-bench run --estimate``) has shapes but no values. Two rules keep its
schedule the same as a real call's, explicitly and never by a default the normal path could take:

* :func:`on_host`: the group's validation and planning read the caller's host tensors, which stay real; they
  run with the fake mode lifted, so an estimate validates the group exactly as a real call does. Outside a fake
  mode it changes nothing.
* :func:`has_values`: a tensor computed under the mode (a loss, a gradient) is fake; the checks of its values
  (the finite guards, the reported loss) are skipped for it, and only for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

__all__ = ["on_host", "has_values"]


@contextlib.contextmanager
def on_host() -> Iterator[None]:
    """Run the body on real tensors even inside a FakeTensorMode (its host reads of the caller's input)."""
    with unset_fake_temporarily():
        yield


def has_values(t: torch.Tensor) -> bool:
    """False for a fake tensor (a value computed under an estimate) or a meta one: nothing to read."""
    return not is_fake(t) and t.device.type != "meta"
