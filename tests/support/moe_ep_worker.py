"""Multi-rank MoE cases (EP, EP x TP, MoE under TP), run on local ranks by tests/prefixflow/moe/test_moe_ep.py.

    python -m harness.execute.local_ranks --nproc-per-node=2 -m support.moe_ep_worker OUT.json

Every rank runs every case in the same order; rank 0 writes ``{case: result}`` to OUT.json. A case trains
one step with routing replay (fp64) and compares the loss and every gradient, gathered to a full tensor,
with one process training the same groups with the baseline: ``max_rel`` = max over parameters of
``max|g - g_ref| / max|g_ref|``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
import traceback

import torch
import torch.distributed as dist

import prefixflow as pf
from prefixflow.moe import MoEConfig, moe_hooks_of, moe_layers, record_routing
from prefixflow.parallel import fsdp as fsdp_mod
from prefixflow.parallel import init_distributed, parallel_state, parallelize
from prefixflow.parallel.dp import train_step
from prefixflow.parallel.mesh import ParallelDims, build_mesh
from support.moe import TINY_MOE, random_routing

VOCAB = 98  # divisible by tp=2
CASES: list[tuple[str, object]] = []
_MESHES: dict[ParallelDims, object] = {}


def case(name: str):
    def register(fn):
        CASES.append((name, fn))
        return fn

    return register


def tiny(config: MoEConfig | None = None, **extra) -> torch.nn.Module:
    overrides = {**TINY_MOE, "vocab_size": VOCAB, **extra}
    model = pf.build_model("qwen3:debugmodel_moe", dtype=torch.float64, seed=0, overrides=overrides)
    if config is not None:
        pf.apply_moe(model, config)
    return pf.apply_prefixflow(model)


def parallel_model(dims: dict, ac: str = "none", config=None, **extra) -> torch.nn.Module:
    key = ParallelDims.of(dims)
    if key not in _MESHES:
        _MESHES[key] = build_mesh(key)
    return parallelize(tiny(config, **extra), key, ac=ac, mesh=_MESHES[key])


def groups_for(n_groups: int, n: int = 3, prompt: int = 12) -> list[pf.RolloutGroup]:
    out = []
    for i in range(n_groups):
        lens = [3 + (5 * i + 3 * j) % 7 for j in range(n)]
        group = pf.synthetic_group(VOCAB, prompt + 3 * i, lens, seed=i)
        out.append(dataclasses.replace(group, routing=random_routing(group, 2, 8, 2, seed=100 + i)))
    return out


def _name(n: str) -> str:
    return n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def reference(groups, layout, microbatch, config=None, **extra) -> tuple[float, float, dict]:
    model = tiny(config, **extra)
    loss = aux = 0.0
    for g in groups:
        loss += pf.train_group(model, g, system="baseline", layout=layout, microbatch=microbatch).loss
        aux += moe_hooks_of(model).aux_loss
    return loss, aux, {_name(n): p.grad.detach().clone() for n, p in model.named_parameters()}


def compare(model, loss: float, ref) -> dict:
    ref_loss, _, ref_grads = ref
    worst, names = 0.0, []
    for n, p in model.named_parameters():
        want = ref_grads[_name(n)]
        got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        got = torch.zeros_like(want) if got is None else got
        worst = max(worst, float((got - want).abs().max()) / (float(want.abs().max()) or 1.0))
        names.append(_name(n))
    return {
        "max_rel": worst,
        "loss_rel": abs(loss - ref_loss) / max(abs(ref_loss), 1e-300),
        "missing_params": sorted(set(ref_grads) - set(names)),
    }


def step_case(dims, *, system, layout="padded", microbatch=None, ac="none", config=None, **extra):
    model = parallel_model(dims, ac=ac, config=config, **extra)
    state = parallel_state(model)
    groups = groups_for(state.dims.batch)
    stats = train_step(
        model, groups, system=system, layout=layout, microbatch=microbatch, split_threshold=None
    )
    ref = reference(groups, layout, microbatch, config, **extra)
    out = compare(model, stats.loss, ref)
    if config is not None and config.aux_loss_coef:
        aux = torch.tensor([moe_hooks_of(model).aux_loss], dtype=torch.float64)
        if state.dims.batch > 1:
            dist.all_reduce(aux, group=state.mesh["batch"].get_group())
        out["aux_rel"] = abs(float(aux) - ref[1]) / abs(ref[1])
    out["experts_local"] = int(moe_layers(model)[0].experts.w1.to_local().shape[0])
    if state.fsdp:
        out["residue"] = fsdp_mod.fsdp_residue(model)
    return out


# (layout, microbatch, ac, system): both layouts, microbatch None/1, AC none/full, both systems
MATRIX = [
    ("padded", None, "none", "prefixflow"),
    ("packed", 1, "full", "prefixflow"),
    ("padded", 1, "full", "baseline"),
    ("packed", None, "none", "baseline"),
]
LAYOUTS = {"ep2": {"dp_shard": 2, "ep": 2}, "ep2xtp2": {"tp": 2, "ep": 2}, "tp2": {"tp": 2}}
for _label, _dims in LAYOUTS.items():
    for _layout, _mb, _ac, _system in MATRIX:
        case(f"{_label}-{_layout}-mb{_mb}-ac_{_ac}-{_system}")(
            lambda d=_dims, la=_layout, m=_mb, a=_ac, s=_system: step_case(
                d, system=s, layout=la, microbatch=m, ac=a
            )
        )

for _label in ("ep2", "ep2xtp2"):
    case(f"{_label}-aux-packed-mb1-prefixflow")(
        lambda d=LAYOUTS[_label]: step_case(
            d, system="prefixflow", layout="packed", microbatch=1, config=MoEConfig(aux_loss_coef=0.5)
        )
    )

# TorchTitan's other MoE layout: gates scale the experts' input; plus a shared expert (TP colwise/rowwise)
for _label in ("tp2", "ep2xtp2", "ep2"):
    case(f"{_label}-score-before-shared-expert-padded-mb1-prefixflow")(
        lambda d=LAYOUTS[_label]: step_case(
            d,
            system="prefixflow",
            microbatch=1,
            **{"moe_args.score_before_experts": True, "moe_args.num_shared_experts": 1},
        )
    )


def _record(label: str) -> dict:
    """Recording under EP (all-to-all; under TP also padded sequences) gives the single process's masks."""
    model = parallel_model(LAYOUTS[label])
    groups = [dataclasses.replace(g, routing=None) for g in groups_for(2)]
    state = parallel_state(model)
    group = groups[state.coordinate("batch") if state.dims.batch > 1 else 0]  # TP ranks share their data
    mine = record_routing(model, group, microbatch=2)
    want = record_routing(tiny(), group, microbatch=2)
    same = torch.equal(mine.prefix, want.prefix) and all(
        torch.equal(a, b) for a, b in zip(mine.suffixes, want.suffixes, strict=True)
    )
    flags = torch.tensor([int(same)])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    return {"same": bool(flags.item())}


for _label in ("ep2", "ep2xtp2"):
    case(f"{_label}-record-routing")(lambda la=_label: _record(la))


@case("ep2-lockstep-mismatch")
def _mismatch() -> dict:
    """Different response counts on the EP ranks: a ValueError on every rank, before any gradient."""
    model = parallel_model(LAYOUTS["ep2"])
    group = groups_for(1, n=2 + dist.get_rank())[0]
    try:
        pf.train_group(model, group)
    except ValueError as e:
        untouched = all(p.grad is None for p in model.parameters())
        return {"raised": "lockstep" in str(e), "untouched": untouched}
    return {"raised": False}


class WrongPrefixMaskInPhaseC(pf.ScheduleHooks):
    """Fault: Phase C's recomputation replays another expert for every cached token (registered after the MoE
    hook, so each microbatch's route plans are set when it enters)."""

    def __init__(self, model) -> None:
        self.model, self.in_c = model, False

    @contextlib.contextmanager
    def phase(self, name):
        self.in_c = name == "C"
        try:
            yield
        finally:
            self.in_c = False

    @contextlib.contextmanager
    def microbatch(self, mb):
        if self.in_c:
            for layer in moe_layers(self.model):
                plan = layer.route_plan
                plan.experts = (plan.experts + 1) % 8
        yield


@case("control-ep2-wrong-prefix-mask-in-phase-c")
def _control() -> dict:
    model = parallel_model(LAYOUTS["ep2"], ac="full")
    pf.add_hooks(model, WrongPrefixMaskInPhaseC(model))
    groups = groups_for(2)
    try:
        stats = train_step(model, groups, system="prefixflow", split_threshold=None)
    except Exception as e:  # a recomputation whose saved tensors differ is also a detected fault
        return {"detected": True, "how": type(e).__name__}
    out = compare(model, stats.loss, reference(groups, "padded", None))
    out["detected"] = out["max_rel"] > 1e-6
    return out


def tree_with_routing(seed: int = 21) -> pf.RolloutTree:
    """A random tree (depth 3, branching up to 3, loss tokens in shared nodes) with random masks per node."""
    from support.tree_reference import random_tree

    tree = random_tree(seed, 3, 3, vocab=VOCAB)
    gen = torch.Generator().manual_seed(seed)
    tree.routing = [
        torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(2 * n)]).view(2, n, 2)
        for n in (tree.node_len(j) for j in range(tree.n_nodes))
    ]
    return tree


def tree_case(dims, *, system, layout, microbatch, ac="none", fault=False) -> dict:
    """One tree on every rank through ``train_group`` (EP borrowing the TP ranks: they share their data; EP
    over dp_shard: FSDP sums the ranks' gradients, so the reference trains the tree once per rank)."""
    model = parallel_model(dims, ac=ac)
    if fault:
        pf.add_hooks(model, WrongPrefixMaskInPhaseC(model))
    tree = tree_with_routing()
    copies = parallel_state(model).dims.batch
    stats = pf.train_group(model, tree, system=system, layout=layout, microbatch=microbatch)
    ref_model = tiny()
    ref_loss = sum(
        pf.train_group(ref_model, tree, system="baseline", layout="padded").loss for _ in range(copies)
    )
    ref = (ref_loss, 0.0, {_name(n): p.grad.detach().clone() for n, p in ref_model.named_parameters()})
    return compare(model, stats.loss * copies, ref)


TREE_MATRIX = [
    ("packed", 2, "none", "prefixflow"),
    ("padded", None, "full", "prefixflow"),
    ("packed", 1, "none", "baseline"),
]
for _label in ("ep2xtp2", "ep2"):
    for _layout, _mb, _ac, _system in TREE_MATRIX:
        case(f"{_label}-tree-{_layout}-mb{_mb}-ac_{_ac}-{_system}")(
            lambda d=LAYOUTS[_label], la=_layout, m=_mb, a=_ac, s=_system: tree_case(
                d, system=s, layout=la, microbatch=m, ac=a
            )
        )


@case("control-ep2xtp2-tree-wrong-mask-in-phase-c")
def _tree_control() -> dict:
    try:
        out = tree_case(
            LAYOUTS["ep2xtp2"], system="prefixflow", layout="packed", microbatch=2, ac="full", fault=True
        )
    except Exception as e:  # a recomputation whose saved tensors differ is also a detected fault
        return {"detected": True, "how": type(e).__name__}
    out["detected"] = out["max_rel"] > 1e-6
    return out


def main(argv: list[str]) -> int:
    (out_path,) = argv
    init_distributed("cpu")
    torch.set_num_threads(1)
    results = {}
    for name, fn in CASES:
        start = time.perf_counter()
        try:
            results[name] = fn()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        results[name]["seconds"] = time.perf_counter() - start
    if dist.get_rank() == 0:
        with open(out_path, "w") as fh:
            json.dump(
                results, fh, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o)
            )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
