"""Multi-rank exactness cases, run on local ranks by tests/test_parallel_*.py (one launch per test module).

    python -m harness.execute.local_ranks --nproc-per-node=N -m support.parallel_worker SUITE OUT.json

Every rank runs every case of SUITE in the same order; rank 0 writes ``{case: result}`` to OUT.json, where a
result holds the measured differences from a single-process reference (fp64) or the error's traceback.
A case compares the loss and every gradient, gathered to a full tensor, with one process training the same
step's groups with the baseline: ``max_rel`` = max over parameters of ``max|g - g_ref| / max|g_ref|``.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
from conftest import TINY

import prefixflow as pf
from prefixflow.parallel import dp as dp_mod
from prefixflow.parallel import fsdp as fsdp_mod
from prefixflow.parallel import init_distributed, parallel_state, parallelize
from prefixflow.parallel.dp import train_step
from prefixflow.parallel.mesh import ParallelDims, build_mesh

VOCAB = 98  # divisible by tp=2 (TorchTitan shards the vocabulary)
SUITES: dict[str, list[tuple[str, Callable[[], dict]]]] = {}
_MESHES: dict[ParallelDims, object] = {}


def case(suite: str, name: str):
    def register(fn):
        SUITES.setdefault(suite, []).append((name, fn))
        return fn

    return register


def tiny(family: str, ac: str = "none") -> torch.nn.Module:
    name, overrides = TINY[family]
    model = pf.build_model(name, dtype=torch.float64, seed=0, overrides={**overrides, "vocab_size": VOCAB})
    return pf.apply_prefixflow(model)


def parallel_model(family: str, dims: dict, ac: str = "none", **kwargs) -> torch.nn.Module:
    key = ParallelDims.of(dims)
    if key not in _MESHES:
        _MESHES[key] = build_mesh(key)
    return parallelize(tiny(family), key, ac=ac, mesh=_MESHES[key], **kwargs)


def groups_for(n_groups: int, ns=(3,), prompt=12, seed=0) -> list[pf.RolloutGroup]:
    out = []
    for i in range(n_groups):
        n = ns[i % len(ns)]
        lens = [3 + (5 * i + 3 * j) % 7 for j in range(n)]
        out.append(pf.synthetic_group(VOCAB, prompt + 3 * i, lens, seed=seed + i))
    return out


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _name(n: str) -> str:
    return n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def reference(family: str, groups, layout, microbatch) -> tuple[float, dict[str, torch.Tensor]]:
    """One process trains every group with the baseline: the loss sum and every gradient."""
    model = tiny(family)
    loss = sum(
        pf.train_group(model, g, system="baseline", layout=layout, microbatch=microbatch).loss for g in groups
    )
    return loss, {_name(n): p.grad.detach().clone() for n, p in model.named_parameters()}


def compare(model, loss: float, ref: tuple[float, dict[str, torch.Tensor]]) -> dict:
    ref_loss, ref_grads = ref
    worst, names = 0.0, []
    for n, p in model.named_parameters():
        want = ref_grads[_name(n)]
        got = full(p.grad) if p.grad is not None else torch.zeros_like(want)
        rel = float((got - want).abs().max()) / (float(want.abs().max()) or 1.0)
        names.append(_name(n))
        worst = max(worst, rel)
    missing = sorted(set(ref_grads) - set(names))
    return {
        "max_rel": worst,
        "loss_rel": abs(loss - ref_loss) / max(abs(ref_loss), 1e-300),
        "missing_params": missing,
    }


@contextlib.contextmanager
def counting_point_to_point(counts: dict[str, int]):
    """Count the bytes of every torch.distributed point-to-point call on this rank (sends, receives)."""
    originals = {name: getattr(dist, name) for name in ("send", "isend", "recv", "irecv")}

    def counted(name, key):
        def call(tensor, *args, **kwargs):
            counts[key] += tensor.numel() * tensor.element_size()
            return originals[name](tensor, *args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, counted(name, "sent" if "send" in name else "received"))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def step_case(
    family,
    dims,
    *,
    system,
    layout="padded",
    microbatch=None,
    ac="none",
    n_groups=None,
    ns=(3,),
    split_threshold=0.25,
    **kwargs,
) -> dict:
    model = parallel_model(family, dims, ac=ac, **kwargs)
    state = parallel_state(model)
    groups = groups_for(n_groups or state.dims.batch, ns)
    with counting_point_to_point({"sent": 0, "received": 0}) as p2p:
        stats = train_step(
            model,
            groups,
            system=system,
            layout=layout,
            microbatch=microbatch,
            split_threshold=split_threshold,
        )
    wire = torch.tensor([p2p["sent"], p2p["received"]], dtype=torch.int64)
    if state.dims.batch > 1:  # the same ranks PrefixExchange sums its counts over
        dist.all_reduce(wire, group=state.mesh["batch"].get_group())
    out = compare(model, stats.loss, reference(family, groups, layout, microbatch))
    out.update(
        grad_sync=stats.grad_sync,
        exchange=stats.exchange,
        split_groups=list(stats.placement.split_groups),
        split_owner_responses=[  # responses each split group's owner trains itself
            len(w.responses)
            for r, ws in enumerate(stats.placement.work)
            for w in ws
            if w.split and w.owner == r
        ],
        point_to_point=dict(zip(("sent", "received"), wire.tolist(), strict=True)),
    )
    if state.fsdp:
        out["residue"] = fsdp_mod.fsdp_residue(model)
    return out


# -- two ranks: TP2, FSDP2, DP2 with placement, DP2 with a split group ---------------------------------
# (family, layout, microbatch, ac, system): both families, both layouts, microbatch None/1, AC none/sel/full
MATRIX = [
    ("llama3", "padded", None, "none", "prefixflow"),
    ("llama3", "packed", 1, "full", "prefixflow"),
    ("llama3", "padded", 1, "selective", "prefixflow"),
    ("llama3", "packed", None, "none", "baseline"),
    ("qwen3", "packed", None, "none", "prefixflow"),
    ("qwen3", "padded", 1, "full", "prefixflow"),
    ("qwen3", "padded", 1, "none", "baseline"),
]
for _label, _dims in (("tp2", {"tp": 2}), ("fsdp2", {"dp_shard": 2})):
    for _fam, _layout, _mb, _ac, _system in MATRIX:
        case("two_ranks", f"{_label}-{_fam}-{_layout}-mb{_mb}-ac_{_ac}-{_system}")(
            lambda f=_fam, la=_layout, m=_mb, a=_ac, s=_system, d=_dims: step_case(
                f, d, system=s, layout=la, microbatch=m, ac=a
            )
        )

# (family, layout, system)
for _fam, _layout, _system in (
    ("llama3", "padded", "prefixflow"),
    ("qwen3", "packed", "prefixflow"),
    ("llama3", "packed", "baseline"),
):
    # three groups of different sizes on two ranks: placement by cost, gradients all-reduced
    case("two_ranks", f"dp2-placement-{_fam}-{_layout}-{_system}")(
        lambda f=_fam, la=_layout, s=_system: step_case(
            f,
            {"dp_replicate": 2},
            system=s,
            layout=la,
            microbatch=1,
            n_groups=3,
            ns=(2, 4, 3),
            split_threshold=None,
        )
    )
    # one group, split across both ranks (owner: Phase A + C, both: Phase B)
    case("two_ranks", f"dp2-split-{_fam}-{_layout}-{_system}")(
        lambda f=_fam, la=_layout, s=_system: step_case(
            f,
            {"dp_replicate": 2},
            system=s,
            layout=la,
            microbatch=None,
            n_groups=1,
            ns=(4,),
            split_threshold=0.0,
        )
    )

# a prompt dearer than both responses: the owner pays the prefix and trains none of them (both go to rank 1)
case("two_ranks", "dp2-split-owner-trains-none-llama3-prefixflow")(
    lambda: step_case(
        "llama3", {"dp_replicate": 2}, system="prefixflow", n_groups=1, ns=(2,), split_threshold=0.0
    )
)
case("two_ranks", "fsdp2-split-llama3-prefixflow")(
    lambda: step_case(
        "llama3", {"dp_shard": 2}, system="prefixflow", n_groups=1, ns=(4,), split_threshold=0.0
    )
)
case("two_ranks", "fsdp2-accumulate-4-groups-llama3-prefixflow")(
    lambda: step_case("llama3", {"dp_shard": 2}, system="prefixflow", microbatch=1, n_groups=4)
)
case("two_ranks", "fsdp2-unbalanced-3-groups-qwen3-prefixflow")(
    lambda: step_case(
        "qwen3", {"dp_shard": 2}, system="prefixflow", n_groups=3, ns=(2, 4, 3), split_threshold=None
    )
)


def _residue_after_each_group() -> dict:
    """Both ranks train the same groups one ``train_group`` at a time (each group reduces its gradients),
    then inside ``accumulate_groups`` (one reduction at the end): after every group (Phase A stopped inside
    the last block each time) FSDP is idle and resharded; the only thing a deferred reduction leaves is the
    unreduced gradients, and nothing is left once the block exits. SUM over 2 ranks = 2x one process."""
    model = parallel_model("llama3", {"dp_shard": 2})
    groups = groups_for(3, ns=(3, 4))
    per_group, deferred = [], []
    for g in groups:
        pf.train_group(model, g, system="prefixflow", microbatch=1)
        per_group.append(fsdp_mod.fsdp_residue(model))
    with fsdp_mod.accumulate_groups(model):
        for g in groups:
            pf.train_group(model, g, system="prefixflow", microbatch=1)
            deferred.append([r for r in fsdp_mod.fsdp_residue(model) if not r.endswith("unreduced gradient")])
    loss, grads = reference("llama3", groups, "padded", 1)
    out = compare(model, 4 * loss, (4 * loss, {k: 4 * v for k, v in grads.items()}))
    out.update(per_group=per_group, deferred=deferred, residue=fsdp_mod.fsdp_residue(model))
    return out


case("two_ranks", "fsdp2-residue-after-each-group")(_residue_after_each_group)


class _FailIn(pf.ScheduleHooks):
    def __init__(self, phase: str) -> None:
        self.at = phase

    @contextlib.contextmanager
    def phase(self, name):
        yield
        if name == self.at:
            raise RuntimeError(f"injected failure after phase {name}")


def _error_then_correct(phase: str) -> dict:
    """An error at the end of ``phase`` leaves no FSDP residue, and the next step is still exact."""
    model = parallel_model("llama3", {"dp_shard": 2})
    groups = groups_for(2)
    hook = pf.add_hooks(model, _FailIn(phase))
    raised = False
    try:
        train_step(model, groups, system="prefixflow" if phase != "full" else "baseline", microbatch=1)
    except RuntimeError:
        raised = True
    residue = fsdp_mod.fsdp_residue(model)
    pf.remove_hooks(model, hook)
    model.zero_grad(set_to_none=True)
    stats = train_step(model, groups, system="prefixflow", microbatch=1)
    out = compare(model, stats.loss, reference("llama3", groups, "padded", 1))
    out.update(raised=raised, residue_after_error=residue, residue=fsdp_mod.fsdp_residue(model))
    return out


for _phase in ("A", "B", "C", "full"):
    case("two_ranks", f"fsdp2-error-in-{_phase}")(lambda p=_phase: _error_then_correct(p))


# Negative controls: each breaks one mechanism the exactness rests on; the test asserts they FAIL.
def _drop_grad_kv() -> dict:
    original = dp_mod.PrefixExchange.receive_grad_kv

    def receive_and_drop(self, cache, helpers):
        saved = {i: (e.prefix_k.grad, e.prefix_v.grad) for i, e in cache.layers.items()}
        original(self, cache, helpers)
        for i, e in cache.layers.items():
            e.prefix_k.grad, e.prefix_v.grad = saved[i]

    dp_mod.PrefixExchange.receive_grad_kv = receive_and_drop
    try:
        return step_case(
            "llama3", {"dp_replicate": 2}, system="prefixflow", n_groups=1, ns=(4,), split_threshold=0.0
        )
    finally:
        dp_mod.PrefixExchange.receive_grad_kv = original


def _skip_fsdp_reduce() -> dict:
    original = fsdp_mod.reduce_gradients
    fsdp_mod.reduce_gradients = lambda model: None
    try:
        model = parallel_model("llama3", {"dp_shard": 2})
        groups = groups_for(2)
        stats = train_step(model, groups, system="prefixflow")
        out = compare(model, stats.loss, reference("llama3", groups, "padded", None))
        fsdp_mod.discard(model)
        return out
    finally:
        fsdp_mod.reduce_gradients = original


case("two_ranks", "control-split-drops-grad-kv")(_drop_grad_kv)
case("two_ranks", "control-fsdp-skips-final-reduce")(_skip_fsdp_reduce)


# -- four ranks: TP2 x FSDP2, TP2 x DP2 with a split group ---------------------------------------------
for _fam in ("llama3", "qwen3"):
    for _layout, _mb, _ac in (("padded", None, "none"), ("packed", 1, "full")):
        case("four_ranks", f"tp2xfsdp2-{_fam}-{_layout}-mb{_mb}-ac_{_ac}-prefixflow")(
            lambda f=_fam, la=_layout, m=_mb, a=_ac: step_case(
                f, {"tp": 2, "dp_shard": 2}, system="prefixflow", layout=la, microbatch=m, ac=a
            )
        )
case("four_ranks", "tp2xfsdp2-llama3-padded-mb1-baseline")(
    lambda: step_case("llama3", {"tp": 2, "dp_shard": 2}, system="baseline", microbatch=1)
)
case("four_ranks", "tp2xdp2-split-qwen3-prefixflow")(
    lambda: step_case(
        "qwen3", {"tp": 2, "dp_replicate": 2}, system="prefixflow", n_groups=1, ns=(4,), split_threshold=0.0
    )
)


def main(argv: list[str]) -> int:
    suite, out_path = argv
    init_distributed("cpu")
    rank = dist.get_rank()
    results = {}
    for name, fn in SUITES[suite]:
        start = time.perf_counter()
        try:
            results[name] = fn()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        results[name]["seconds"] = time.perf_counter() - start
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(
                results, fh, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o)
            )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
