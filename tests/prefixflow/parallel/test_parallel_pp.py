"""Pipeline parallelism (prefixflow.parallel.pp): PP2 against the single-process baseline, one torchrun launch.

Every case cuts the fp64 tiny model into 2 stages with TorchTitan's split (through ``parallelize``), trains one
rollout group with the stage program (stage-local switching unless named otherwise) and compares each stage's gradients, by parameter
name, and the loss with the single-process baseline (bound 1e-9 relative).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from support.torchrun_cases import launch_cases, max_rel, run_worker

BOUND = 1e-9
TREE_BOUND = 1e-12  # prefix trees on the pipeline (fp64)
LENS = [5, 9, 3, 6]


def _cases() -> dict:
    cases = {}
    for system in ("baseline", "prefixflow"):
        for layout in ("padded", "packed"):
            for mb in (None, 1):
                cases[f"{system}-{layout}-{mb}"] = dict(system=system, layout=layout, microbatch=mb)
    cases["prefixflow-padded-1-barrier"] = dict(
        system="prefixflow", layout="padded", microbatch=1, switching="barrier"
    )
    cases["prefixflow-packed-2-barrier"] = dict(
        system="prefixflow", layout="packed", microbatch=2, switching="barrier"
    )
    cases["prefixflow-padded-1-qwen3"] = dict(
        system="prefixflow", layout="padded", microbatch=1, family="qwen3", untie=True
    )
    cases["prefixflow-padded-1-ac-selective"] = dict(
        system="prefixflow", layout="padded", microbatch=1, ac="selective"
    )
    cases["prefixflow-packed-1-split-before-wrap"] = dict(
        system="prefixflow", layout="packed", microbatch=1, split_first=True
    )
    cases["prefixflow-one-token-prompt"] = dict(
        system="prefixflow", layout="padded", microbatch=2, prompt_len=1
    )
    cases.update(tree_cases())
    return cases


def tree_cases(prefix: str = "") -> dict:
    """Prefix trees on pipeline stages: each cached node's forward flows down the pipe and its backward back
    up, per wave (depth 3, branching up to 3, loss tokens in shared nodes)."""
    settings = [
        ("prefixflow", "padded", None, "stage_local", "none"),
        ("prefixflow", "packed", 1, "stage_local", "none"),
        ("prefixflow", "packed", 2, "barrier", "none"),
        ("prefixflow", "padded", 2, "stage_local", "full"),
        ("baseline", "packed", 2, "stage_local", "none"),
    ]
    return {
        f"{prefix}tree-{system}-{layout}-{mb}-{switching}-ac_{ac}": dict(
            system=system, layout=layout, microbatch=mb, switching=switching, ac=ac, tree=21
        )
        for system, layout, mb, switching, ac in settings
    }


CASES = _cases()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp") / "pp.json"
    return launch_cases(Path(__file__), 2, out)


def _get(results, name):
    res = results[name]
    assert "error" not in res, res.get("error")
    return res


@pytest.mark.parametrize("name", sorted(CASES))
def test_pp2_matches_single_process_baseline_fp64(results, name):
    res = _get(results, name)
    assert res["n_params"] == res["n_params_ref"]  # every parameter lives on exactly one stage
    bound = TREE_BOUND if "tree" in CASES[name] else BOUND
    assert res["grad_rel"] < bound, res
    assert res["loss_rel"] < bound, res


def test_a_tree_node_backward_without_the_next_stages_gradient_is_caught(results):
    """Negative control: each stage seeds its nodes' backward with their gK/gV alone, dropping the gradient
    the next stage sent back for the node's output."""
    res = _get(results, "tree-fault-no-stage-seeds")
    assert res["grad_rel"] > 1e-3, res


@pytest.mark.parametrize("name", ["prefixflow-padded-1", "prefixflow-padded-1-barrier"])
def test_stage_timelines_follow_the_program(results, name):
    from prefixflow.parallel.pp import stage_program

    res, case = _get(results, name), CASES[name]
    n_mb = -(-len(LENS) // case["microbatch"])
    for stage, events in enumerate(res["timelines"]):
        program = stage_program(case.get("switching", "stage_local"), 2, stage, n_mb, True)
        assert [(e["op"],) if e["mb"] is None else (e["op"], e["mb"]) for e in events] == program
        for e in events:
            assert e["wait"] <= e["start"] <= e["end"]
    # The stages ran on one host: the timelines share its monotonic clock (pp_stage's _gather_timelines), so
    # these are causal facts through the messages and barriers, with no allowance for clock skew.
    first, last = res["timelines"]
    a0 = next(e for e in first if e["op"] == "A")
    a1 = next(e for e in last if e["op"] == "A")
    c0 = next(e for e in first if e["op"] == "C")
    c1 = next(e for e in last if e["op"] == "C")
    assert a1["start"] > a0["end"]  # stage 1's prefix forward needs stage 0's prefix output
    assert c0["start"] > c1["end"]  # stage 0's prefix backward needs stage 1's gradient of it
    for m in range(n_mb):  # each microbatch's forward flows down, its backward back up
        f = [next(e for e in t if e["op"] == "F" and e["mb"] == m) for t in (first, last)]
        b = [next(e for e in t if e["op"] == "B" and e["mb"] == m) for t in (first, last)]
        assert f[1]["start"] > f[0]["end"] and b[0]["start"] > b[1]["end"]
    last_b0 = max(e["end"] for e in first if e["op"] == "B")
    f0 = min(e["start"] for e in first if e["op"] == "F")
    if case.get("switching") == "barrier":
        assert f0 > a1["end"]  # nothing of Phase B starts before every stage finished Phase A
        assert c1["start"] > last_b0  # ... and Phase C waits for the whole pipeline's Phase B
    # Stage-local switching lets these overlap (stage 0's F0 with stage 1's A, stage 1's C with stage 0's last
    # B): the program above has no barrier; by how much they overlap is a timing, measured in the records
    # (Figure 6b), not asserted here.
    assert res["pp_bubble_max_s"] >= res["pp_bubble_mean_s"] >= 0


def test_pp2_alignment_rows_cover_every_stage_and_agree_on_every_rank(results):
    res = _get(results, "alignment")
    assert res["same_on_every_rank"]  # each stage compared only its own parameters before the merge
    rows = res["rows"]
    assert [(r["step"], r["quantity"]) for r in rows] == [(1, "G"), (1, "L"), (1, "W")]
    assert all(r["passed"] and r["dtype"] == "fp64" for r in rows), rows
    assert rows[0]["norm_rel_diff"] < BOUND


def test_stage_program_is_1f1b_inside_the_prefix_phases():
    from prefixflow.parallel.pp import stage_program

    assert stage_program("stage_local", 2, 0, 3, True) == [
        ("A",),
        ("F", 0),
        ("F", 1),
        ("B", 0),
        ("F", 2),
        ("B", 1),
        ("B", 2),
        ("C",),
    ]
    assert stage_program("stage_local", 2, 1, 3, True) == [
        ("A",),
        ("F", 0),
        ("B", 0),
        ("F", 1),
        ("B", 1),
        ("F", 2),
        ("B", 2),
        ("C",),
    ]
    barrier = stage_program("barrier", 4, 3, 2, True)
    assert barrier == [("A",), ("barrier",), ("F", 0), ("B", 0), ("F", 1), ("B", 1), ("barrier",), ("C",)]
    assert stage_program("stage_local", 4, 0, 2, False) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    with pytest.raises(ValueError, match="switching"):
        stage_program("global", 2, 0, 1, True)


# --- drift between the shapes: PP runs the one driver's guard, extra losses and LM head -------------------
DRIFT_CASES = ("nanloss", "moe-aux-prefixflow", "moe-aux-baseline")


@pytest.mark.parametrize("name", ["nanloss"])
def test_pp2_non_finite_loss_raises_on_every_stage_and_keeps_grads(results, name):
    assert_non_finite_refused(_get(results, name), world=2)


def assert_non_finite_refused(res: dict, world: int) -> None:
    assert res["spoiled_ranks"] == 1, res  # one last-stage rank saw the NaN loss
    assert res["raised_ranks"] == world, res  # ... and every rank of every stage refused the group
    assert res["named_ranks"] == 1, res  # the rank that saw it names the microbatch
    assert res["grads_kept"] == world, res  # every .grad bit-identical to before the call
    assert res["after_grad_rel"] < BOUND, res  # the next group trains as if nothing happened


@pytest.mark.parametrize("name", ["moe-aux-prefixflow", "moe-aux-baseline"])
def test_pp2_moe_balance_loss_matches_single_process_fp64(results, name):
    assert_moe_matches(_get(results, name))


def assert_moe_matches(res: dict) -> None:
    assert res["n_params"] == res["n_params_ref"], res
    assert res["aux_moves_grads"] > 1e-3, res  # the balance loss is not negligible in these gradients
    assert res["grad_rel"] < BOUND and res["loss_rel"] < BOUND, res


def test_pp_refuses_models_it_cannot_cut():
    """An HF model cannot go through TorchTitan's pipeline split: refused in one line, before any mesh is used."""
    from prefixflow.parallel.pp import apply_pp

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    with pytest.raises(
        ValueError, match=r"^pipeline parallelism cuts TorchTitan models[^\n]*LlamaForCausalLM is a hf model"
    ) as err:
        apply_pp(model, None)
    assert "\n" not in str(err.value)


# --- worker (runs under torchrun) -------------------------------------------------------------------------

_MESHES: dict = {}


def _mesh(dims: dict):
    from prefixflow.parallel import ParallelDims, build_mesh

    key = tuple(sorted(dims.items()))
    if key not in _MESHES:
        _MESHES[key] = build_mesh(ParallelDims.of(dims), "cpu")
    return _MESHES[key]


def run_pp_case(spec: dict, lens=LENS, pp: int = 2, cp: int = 1, tp: int = 1) -> dict:
    """Train one group on this rank's stage; max relative differences over all ranks (identical everywhere).

    The stage comes from ``parallelize`` (PP split, TP, CP, AC in TorchTitan's order) on a wrapped model, or,
    with ``split_first``, from ``apply_pp`` on the plain model followed by ``apply_prefixflow``."""
    import torch.distributed as dist
    from conftest import TINY, tiny_model

    import prefixflow as pf
    from prefixflow.parallel import parallelize
    from prefixflow.parallel.pp import apply_pp
    from prefixflow.runtime import runtime_of

    family, ac = spec.get("family", "llama3"), spec.get("ac", "none")
    extra = {"enable_weight_tying": False} if spec.get("untie") else {}
    if tp > 1:
        extra["vocab_size"] = 96  # TorchTitan's plan shards the vocabulary over the TP ranks
    group = pf.synthetic_group(extra.get("vocab_size", 97), spec.get("prompt_len", 14), lens, seed=5)
    if "tree" in spec:
        from support.tree_reference import random_tree

        group = random_tree(spec["tree"], 3, 3, vocab=extra.get("vocab_size", 97))
    ref = tiny_model(family, ac=ac, **extra)
    ref_stats = pf.train_group(ref, group, system="baseline", layout="padded")
    want = {n: p.grad for n, p in ref.named_parameters()}

    dims = {"pp": pp, "cp": cp, "tp": tp}
    mesh = _mesh(dims)
    name, overrides = TINY[family]
    model = pf.build_model(name, dtype=torch.float64, seed=0, overrides={**overrides, **extra})
    switching = spec.get("switching", "stage_local")
    if spec.get("split_first"):
        stage = apply_pp(model, mesh["pp"], switching=switching)
        pf.apply_ac(stage, ac)
        pf.apply_prefixflow(stage)
    else:
        stage = parallelize(pf.apply_prefixflow(model), dims, ac=ac, mesh=mesh, pp_switching=switching)
    if spec.get("fault"):  # drop the next stage's gradient from every node's backward
        pipe = runtime_of(stage).stage
        honest = pipe.node_seeds

        def no_seeds(run, j):
            honest(run, j)  # the gradient still arrives (the next stage's send completes), and is dropped
            return [], []

        pipe.node_seeds = no_seeds
    stats = pf.train_group(
        stage, group, system=spec["system"], layout=spec["layout"], microbatch=spec["microbatch"]
    )
    named = [
        (n, p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
        for n, p in stage.named_parameters()
    ]
    worst = max_rel([g for _, g in named], [want[n] for n, _ in named])
    n_params = torch.tensor([float(len(named))])
    out = torch.tensor([worst, abs(stats.loss - ref_stats.loss) / abs(ref_stats.loss)], dtype=torch.float64)
    out = out.nan_to_num(nan=float("inf"))
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    dist.all_reduce(n_params)
    n_params /= cp * tp  # every stage's parameters, counted once
    return {
        "grad_rel": out[0].item(),
        "loss_rel": out[1].item(),
        "n_params": int(n_params.item()),
        "n_params_ref": len(want),
        "timelines": runtime_of(stage).stage.timelines,
        **stats.hooks,
    }


def _whole(grad):
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def _stage_model(build, pp: int, cp: int):
    from prefixflow.parallel import parallelize

    dims = {"pp": pp, "cp": cp}
    return parallelize(build(), dims, mesh=_mesh(dims))


def run_nanloss_case(pp: int = 2, cp: int = 1) -> dict:
    """A NaN loss in one microbatch on one last-stage rank: every rank of every stage raises NonFiniteError,
    every ``.grad`` stays bit-identical to before the call, and the next group still matches the baseline."""
    import torch.distributed as dist
    from conftest import tiny_model

    import prefixflow as pf
    import prefixflow.schedule.stage as stage_module
    from prefixflow.runtime import runtime_of

    group = pf.synthetic_group(97, 14, LENS, seed=5)
    ref = tiny_model("llama3")
    pf.train_group(ref, group, system="baseline")
    pf.train_group(ref, group, system="baseline")
    want = {n: p.grad for n, p in ref.named_parameters()}
    stage = _stage_model(lambda: tiny_model("llama3"), pp, cp)
    pf.train_group(stage, group, microbatch=1)  # gradients from a first, good group
    before = [_whole(p.grad).clone() for p in stage.parameters()]
    me, world = dist.get_rank(), dist.get_world_size()
    last = runtime_of(stage).stage.last
    loss_of, spoiled = stage_module.microbatch_loss, []

    def nan_loss(*args, **kwargs):  # the last rank's first microbatch only
        value = loss_of(*args, **kwargs)
        if me == world - 1 and not spoiled:
            spoiled.append(1)
            return value * float("nan")
        return value

    stage_module.microbatch_loss = nan_loss
    raised = named = 0
    try:
        pf.train_group(stage, group, microbatch=1)
    except pf.NonFiniteError as err:
        raised, named = 1, int("non-finite loss" in str(err))
    finally:
        stage_module.microbatch_loss = loss_of
    kept = int(all(torch.equal(_whole(p.grad), b) for p, b in zip(stage.parameters(), before, strict=True)))
    pf.train_group(stage, group, microbatch=1)
    named_grads = [(n, _whole(p.grad)) for n, p in stage.named_parameters()]
    after = max_rel([g for _, g in named_grads], [want[n] for n, _ in named_grads])
    counts = torch.tensor([len(spoiled) * int(last), raised, named, kept], dtype=torch.float64)
    dist.all_reduce(counts)
    worst = torch.tensor([after], dtype=torch.float64).nan_to_num(nan=float("inf"))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    spoiled_ranks, raised_ranks, named_ranks, grads_kept = (int(x) for x in counts.tolist())
    return dict(
        spoiled_ranks=spoiled_ranks, raised_ranks=raised_ranks, named_ranks=named_ranks,
        grads_kept=grads_kept, after_grad_rel=worst.item(),
    )  # fmt: skip


def run_moe_case(system: str, pp: int = 2, cp: int = 1) -> dict:
    """Qwen3-MoE with routing replay and a large balance loss (coefficient 0.5): each stage's MoE layers add
    their balance loss to its objective; fp64 against the single-process baseline."""
    import torch.distributed as dist
    from support.moe import tiny_moe, with_routing

    import prefixflow as pf
    from prefixflow.moe import MoEConfig

    config = MoEConfig(aux_loss_coef=0.5)
    ref = tiny_moe(config=config, enable_weight_tying=False)
    group = pf.synthetic_group(97, 14, LENS, seed=5)
    group = with_routing(group, pf.record_routing(ref, group))
    ref_stats = pf.train_group(ref, group, system="baseline", microbatch=1)
    want = {n: p.grad.clone() for n, p in ref.named_parameters()}
    plain = tiny_moe(config=MoEConfig(), enable_weight_tying=False)
    pf.train_group(plain, group, system="baseline", microbatch=1)
    moves = max_rel([p.grad for _, p in plain.named_parameters()], list(want.values()))
    stage = _stage_model(lambda: tiny_moe(config=config, enable_weight_tying=False), pp, cp)
    stats = pf.train_group(stage, group, system=system, layout="packed", microbatch=1)
    named = [(n, _whole(p.grad)) for n, p in stage.named_parameters()]
    worst = max_rel([g for _, g in named], [want[n] for n, _ in named])
    out = torch.tensor([worst, abs(stats.loss - ref_stats.loss) / abs(ref_stats.loss)], dtype=torch.float64)
    out = out.nan_to_num(nan=float("inf"))
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    n_params = torch.tensor([float(len(named))])
    dist.all_reduce(n_params)
    return dict(
        grad_rel=out[0].item(), loss_rel=out[1].item(), aux_moves_grads=moves,
        n_params=int(n_params.item() / cp), n_params_ref=len(want),
    )  # fmt: skip


def drift_cases(pp: int = 2, cp: int = 1, prefix: str = "") -> dict:
    """The drift cases on ``pp`` x ``cp`` ranks, named ``prefix + name``."""
    return {
        f"{prefix}nanloss": lambda: run_nanloss_case(pp, cp),
        f"{prefix}moe-aux-prefixflow": lambda: run_moe_case("prefixflow", pp, cp),
        f"{prefix}moe-aux-baseline": lambda: run_moe_case("baseline", pp, cp),
    }


def run_alignment_case() -> dict:
    """``run_parallel_alignment`` under PP2 (fp64, one step, microbatch 1): the rows, and whether every rank
    returned the same ones (each stage compares only its own parameters until the rows are merged)."""
    import torch.distributed as dist
    from conftest import TINY

    from prefixflow.parallel.align import run_parallel_alignment

    name, overrides = TINY["llama3"]
    rows = run_parallel_alignment(
        name, dims={"pp": 2}, overrides=overrides, dtype=torch.float64, steps=1, report_steps=(1,),
        prefix_len=14, suffix_len=8, microbatch=1,
    )  # fmt: skip
    rows = [r.as_dict() for r in rows]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, json.dumps(rows))  # as JSON: NaN fields (margin) compare equal
    return {"rows": rows, "same_on_every_rank": len(set(every)) == 1}


if __name__ == "__main__":
    cases = {name: (lambda spec=spec: run_pp_case(spec)) for name, spec in CASES.items()}
    fault = dict(system="prefixflow", layout="packed", microbatch=2, tree=21, fault=True)
    cases["tree-fault-no-stage-seeds"] = lambda: run_pp_case(fault)
    cases["alignment"] = run_alignment_case
    cases.update(drift_cases())
    run_worker(
        cases,
        sys.argv[1],
        sys.argv[2:],
    )
