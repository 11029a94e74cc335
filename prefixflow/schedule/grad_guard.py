"""``param.grad`` never receives a non-finite value, and a failing ``train_group`` leaves it as it was.

How: the call accumulates into fresh gradient tensors. The ones from before the call are set aside (a
pointer swap, no copy) and the call's gradients are added to them only once the call has succeeded and
every new gradient is finite (one fused check). On any error, or a non-finite gradient, the old tensors are
put back untouched. Cost: one add per parameter that already had a gradient, and, only then, one extra
gradient buffer while the call runs (a caller that zeroes with ``set_to_none=True`` pays neither).

The guard nests: inside an enclosing ``keep_grads_on_failure`` on the same model, an inner one is a no-op,
and the enclosing one checks and merges once for everything its body accumulated (``actor_update`` wraps
its ``train_group`` calls this way: one check per optimizer step, not one check and merge per group).

On a parallelized model (``prefixflow.parallel``) the verdict is collective: each rank checks its own
gradient shards, then one all-reduce of the flag over every rank of the model's mesh (gloo on CPU, NCCL on
CUDA), so either every rank raises NonFiniteError (gradients restored) or every rank proceeds. Under TP or
FSDP one rank's shard may hold an inf that another's does not; a local verdict would let that rank raise
while another steps into the next collective, and hang. Every rank of the mesh must therefore enter the
outermost guard equally often (it does: ``train_group`` on every rank, or ``actor_update`` /
``train_step`` once per step, whose inner guards are no-ops). An unparallelized model pays no collective.

A non-finite *loss* is refused before its backward on one process. On a parallelized model the ranks'
losses differ (other groups under DP, other tokens under CP), and a rank that raised there would leave the
others waiting in the backward's collectives. There the loss check only notes the microbatch, the backward
runs (its gradients come out non-finite, or the note alone fails the check), and the guard's collective
verdict refuses the step on every rank, naming the microbatch on the rank that saw it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..runtime import runtime_of
from .host import has_values

__all__ = ["NonFiniteError", "keep_grads_on_failure", "check_finite_loss", "all_finite"]


class NonFiniteError(ValueError):
    """A loss or gradient of a ``train_group`` call is NaN or infinite; ``param.grad`` is as before the call."""


def check_finite_loss(value: torch.Tensor, where: str, model: nn.Module | None = None) -> None:
    """Raise NonFiniteError naming ``where`` if the scalar loss ``value`` is not finite (before its backward).
    On a parallelized ``model`` inside its guard, note it instead: the guard refuses the step on every rank."""
    if not has_values(value):  # a fake loss (an estimate): no value to check
        return
    if not bool(torch.isfinite(value.detach())):
        guard = None if model is None else runtime_of(model, create=True).guard
        if guard is not None and guard.get("active") and _mesh_size(model) > 1:
            if guard.get("bad_loss") is None:
                guard["bad_loss"] = f"{where} has a non-finite loss ({float(value.detach())})"
            return
        raise NonFiniteError(
            f"{where} has a non-finite loss ({float(value.detach())}); its backward was not run and param.grad "
            "is as before this call. Check the advantages, log-probs and loss_config for extreme values."
        )


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every value of ``tensors`` is finite, in one read of each tensor and one host sync. A tensor's
    min and max are finite iff all its values are (min/max propagate NaN), so no boolean mask is allocated:
    per-tensor ``isfinite(g).all()`` writes a mask the size of the model and was most of this guard's cost."""
    bounds = [torch.stack(torch.aminmax(t)) for t in tensors if t.numel() and has_values(t)]  # fake: no values
    return not bounds or bool(torch.isfinite(torch.stack([b.double() for b in bounds])).all())


def _mesh_size(model: nn.Module) -> int:
    state = runtime_of(model, create=True).parallel  # what prefixflow.parallel.parallelize set up
    return 1 if state is None else state.mesh.size()


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's values of a (possibly sharded DTensor) gradient: checking them needs no collective."""
    return grad.to_local() if hasattr(grad, "to_local") else grad


def _agreed(model: nn.Module, finite: bool) -> bool:
    """``finite`` on every rank of a parallelized ``model``'s mesh (one all-reduce), else this rank's own."""
    if _mesh_size(model) == 1:
        return finite
    state = runtime_of(model, create=True).parallel
    flag = torch.tensor([0 if finite else 1], dtype=torch.int32, device=state.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=state.model_group)
    return not bool(flag.item())


@contextlib.contextmanager
def keep_grads_on_failure(model: nn.Module) -> Iterator[None]:
    """Run the body into fresh ``.grad`` tensors; merge them into the previous ones only if all are finite.
    On an exception, or a non-finite new gradient (NonFiniteError), the previous gradients are restored.
    Nested on the same model, only the outermost guard acts (see the module docstring)."""
    guard = runtime_of(model, create=True).guard  # active: the outermost guard's body runs; bad_loss: a
    if guard.get("active"):  # parallel model's first non-finite loss in it
        yield
        return
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    before = [p.grad for _, p in named]
    for _, p in named:
        p.grad = None
    guard.update(active=True, bad_loss=None)
    try:
        yield
        new = [(name, _local(p.grad)) for name, p in named if p.grad is not None]
        bad_loss = guard.get("bad_loss")
        local = bad_loss is None and all_finite([g for _, g in new])
        if not _agreed(model, local):
            bad = next((name for name, g in new if not bool(torch.isfinite(g).all())), None)
            if bad_loss is not None:
                where = bad_loss
            elif bad is not None:
                where = f"the gradient of {bad} is not finite"
            else:
                where = "a gradient or loss on another rank is not finite"
            raise NonFiniteError(
                f"{where} (overflow or a bad input); param.grad is as before this call. Check the "
                "advantages, log-probs and loss_config for extreme values."
            )
    except BaseException:
        for (_, p), old in zip(named, before, strict=True):
            p.grad = old
        raise
    finally:
        guard.update(active=False, bad_loss=None)
    for (_, p), old in zip(named, before, strict=True):
        if old is None:
            continue
        if p.grad is not None:
            old.add_(p.grad)
        p.grad = old
