"""Prefix trees under TP2, FSDP2, CP2 and DP2 (one launch of two local ranks), fp64.

Each case trains random trees (depth 3, branching up to 3, loss tokens in shared nodes) on two ranks and
compares the loss and every gradient (gathered to full tensors) with one process training the same trees
with the baseline: ``max_rel`` = max over parameters of ``max|g - g_ref| / max|g_ref|`` (bound 1e-9).
- TP2 and CP2: both ranks train the same tree (CP: each rank its head-tail share of every node and leaf
  row; each ancestor's K/V gathered per layer).
- FSDP2: each rank trains its own tree through ``train_group``; FSDP sums the gradients, so the reference
  is both trees.
- DP2 (``train_step``): three trees of different sizes placed whole on the ranks by the cost model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from support.torchrun_cases import launch_cases, max_rel, run_worker

BOUND = 1e-9
N_LAYERS = 2
GRPO = {"kl_coef": 0.05, "clip_eps_low": 0.1, "clip_eps_high": 0.15}
DIMS = {"tp2": {"tp": 2}, "fsdp2": {"dp_shard": 2}, "cp2": {"cp": 2}}
# (family, layout, microbatch, ac, system, loss)
SETTINGS = [
    ("llama3", "padded", None, "none", "prefixflow", "pg"),
    ("llama3", "packed", 1, "none", "prefixflow", "pg"),
    ("qwen3", "packed", 3, "full", "prefixflow", "pg"),
    ("qwen3", "padded", 2, "none", "prefixflow", "grpo"),
    ("llama3", "packed", 2, "none", "baseline", "pg"),
]


def _cases() -> dict:
    cases = {}
    for label, dims in DIMS.items():
        for fam, layout, mb, ac, system, loss in SETTINGS:
            name = f"{label}-{fam}-{layout}-mb{mb}-ac_{ac}-{system}-{loss}"
            # FSDP2: one tree per rank through train_step (ranks do different work: parameters gathered for
            # the step); TP2/CP2: both ranks train the same tree
            mode, n = ("step", 2) if label == "fsdp2" else ("same", 1)
            cases[name] = dict(
                dims=dims,
                family=fam,
                layout=layout,
                microbatch=mb,
                ac=ac,
                system=system,
                loss=loss,
                mode=mode,
                n=n,
            )
    # ZeRO-3 FSDP (every unit resharded after its forward): both ranks train the same tree in lockstep
    for fam, layout, mb, ac in (("llama3", "packed", 1, "none"), ("qwen3", "padded", None, "full")):
        cases[f"fsdp2-zero3-{fam}-{layout}-mb{mb}-ac_{ac}"] = dict(
            dims={"dp_shard": 2}, family=fam, layout=layout, microbatch=mb, ac=ac, system="prefixflow",
            loss="pg", mode="zero3", n=1,
        )  # fmt: skip
    for fam, layout, system in (("llama3", "padded", "prefixflow"), ("qwen3", "packed", "baseline")):
        cases[f"dp2-placement-{fam}-{layout}-{system}"] = dict(
            dims={"dp_replicate": 2}, family=fam, layout=layout, microbatch=2, ac="none", system=system,
            loss="pg", mode="step", n=3,
        )  # fmt: skip
    cases["cp2-sequence-importance-sampling-refused"] = dict(refusal=True)
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch_cases(Path(__file__), 2, tmp_path_factory.mktemp("tree_parallel") / "out.json")


def _get(results, name):
    res = results[name]
    assert "error" not in res, res.get("error")
    return res


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if not c.get("refusal")))
def test_trees_under_parallelism_match_one_process_fp64(results, name):
    res = _get(results, name)
    assert res["grad_rel"] < BOUND, res
    assert res["loss_rel"] < BOUND, res


def test_cp_gathers_each_ancestor_per_layer_with_prefetch(results):
    res = _get(results, "cp2-llama3-padded-mbNone-ac_none-prefixflow-pg")
    # every forward that reads ancestors gathers its first layer on demand and prefetches the next ones, but
    # none past the layer a forward stops at (a node that scores nothing never reads its last layer's view)
    assert res["cp_demand_gathers"] > 0 and res["stopped_reads"] > 0, res
    assert res["cp_prefetched_gathers"] == res["cp_demand_gathers"] * (N_LAYERS - 1) - res["stopped_reads"], (
        res
    )
    assert res["cp_unused_prefetches"] == 0
    # gK/gV go back once per gathered view that received a gradient (not the last layer's view of a node
    # that scores no token: nothing reads that attention output)
    assert 0 < res["cp_scatters"] <= res["cp_prefetched_gathers"] + res["cp_demand_gathers"]
    assert res["cp_sequence_exchanges"] > 0


def test_dp_places_whole_trees_by_cost(results):
    res = _get(results, "dp2-placement-llama3-padded-prefixflow")
    work = res["placement"]["work"]
    assert sorted(g for ws in work for g, _, _ in ws) == [0, 1, 2]  # every tree once, none split
    assert not res["placement"]["split_groups"] and all(work)


def test_cp_refuses_sequence_importance_sampling_before_any_work(results):
    res = _get(results, "cp2-sequence-importance-sampling-refused")
    assert res["refused"].startswith(
        "loss_config.importance_sampling='sequence' needs each response's tokens"
    )
    assert res["grads_untouched"]


# --- worker (runs on every rank) --------------------------------------------------------------------------
VOCAB = 98  # divisible by tp=2 (TorchTitan shards the vocabulary)


def _model(family: str):
    from conftest import TINY

    import prefixflow as pf

    name, overrides = TINY[family]
    model = pf.build_model(name, dtype=torch.float64, seed=0, overrides={**overrides, "vocab_size": VOCAB})
    return pf.apply_prefixflow(model)


def _trees(n: int, grpo: bool):
    from support.tree_reference import random_tree

    return [random_tree(23 + 7 * k, 3, 3, grpo=grpo, vocab=VOCAB) for k in range(n)]


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _run_case(spec: dict) -> dict:
    import torch.distributed as dist

    import prefixflow as pf
    from prefixflow.parallel import parallelize
    from prefixflow.parallel.dp import train_step
    from prefixflow.parallel.mesh import ParallelDims, build_mesh
    from prefixflow.tree.plan import TreeRows

    if spec.get("refusal"):
        return _refusal_case()
    mode = spec["mode"]
    trees = _trees(spec["n"], spec["loss"] == "grpo")
    kwargs = dict(loss=spec["loss"], loss_config=GRPO if spec["loss"] == "grpo" else None)
    ref = _model(spec["family"])
    ref_trees = trees * dist.get_world_size() if mode == "zero3" else trees  # FSDP sums the ranks' trees
    want_loss = sum(
        pf.train_group(ref, t, system="baseline", layout="padded", **kwargs).loss for t in ref_trees
    )
    want = [p.grad for p in ref.parameters()]
    dims = ParallelDims.of(spec["dims"])
    model = parallelize(_model(spec["family"]), dims, ac=spec["ac"], mesh=build_mesh(dims))
    run = dict(system=spec["system"], layout=spec["layout"], microbatch=spec["microbatch"], **kwargs)
    out = {}
    if mode == "step":
        stats = train_step(model, trees, **run)
        got_loss, out["placement"], out["grad_sync"] = stats.loss, stats.placement.as_dict(), stats.grad_sync
    else:
        stats = pf.train_group(model, trees[0], **run)
        got_loss = stats.loss * (dist.get_world_size() if mode == "zero3" else 1)
        out.update({k: v for k, v in stats.hooks.items() if k.startswith("cp_")})
        # A cached node that scores nothing stops after its last layer's K/V: its forward reads (and
        # prefetches) none of its ancestors' last-layer views (one view per ancestor)
        rows = TreeRows(trees[0])
        out["stopped_reads"] = sum(
            len(rows.key_nodes([rows.node_rows[j]])) for j in rows.cached if not rows.scores(j)
        )
    got = [_full(p.grad) for p in model.parameters()]
    worst = torch.tensor(
        [max_rel(got, want), abs(got_loss - want_loss) / abs(want_loss)], dtype=torch.float64
    ).nan_to_num(nan=float("inf"))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"grad_rel": worst[0].item(), "loss_rel": worst[1].item(), **out}


def _refusal_case() -> dict:
    import torch.distributed as dist

    import prefixflow as pf
    from prefixflow.parallel.cp import apply_cp

    model = _model("llama3")
    apply_cp(model, dist.group.WORLD)
    tree = _trees(1, True)[0]
    before = [p.grad for p in model.parameters()]
    try:
        pf.train_group(model, tree, loss="grpo", loss_config={"importance_sampling": "sequence"})
    except ValueError as e:
        refused = str(e)
    else:
        refused = "not refused"
    untouched = all(p.grad is b for p, b in zip(model.parameters(), before, strict=True))
    return {"refused": refused, "grads_untouched": untouched}


if __name__ == "__main__":
    run_worker(
        {name: (lambda s=spec: _run_case(s)) for name, spec in CASES.items()}, sys.argv[1], sys.argv[2:]
    )
