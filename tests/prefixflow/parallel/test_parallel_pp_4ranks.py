"""PP2 x CP2 and PP2 x TP2 on 4 ranks: fp64 against the single-process baseline, one torchrun.

The one driver's guard under PP2 x CP2: a NaN loss on one rank; MoE under CP is refused.
Under CP each stage shards its prefix and every microbatch over its CP pair and activations cross stages as
CP shards; under TP each stage runs TorchTitan's plan and activations cross stages sequence-sharded.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from support.torchrun_cases import launch_cases, run_worker
from test_parallel_pp import (
    BOUND,
    TREE_BOUND,
    assert_non_finite_refused,
    drift_cases,
    run_pp_case,
    tree_cases,
)


def _cases() -> dict:
    cases = {}
    for par in ("cp", "tp"):
        for system in ("baseline", "prefixflow"):
            for layout in ("padded", "packed"):
                for mb in (None, 1):
                    cases[f"pp2{par}2-{system}-{layout}-{mb}"] = dict(
                        par=par, system=system, layout=layout, microbatch=mb
                    )
    cases["pp2cp2-prefixflow-padded-2-barrier"] = dict(
        par="cp", system="prefixflow", layout="padded", microbatch=2, switching="barrier"
    )
    for name, spec in tree_cases("pp2cp2-").items():
        cases[name] = dict(spec, par="cp")
    return cases


CASES = _cases()
DRIFT = {k: v for k, v in drift_cases(pp=2, cp=2, prefix="pp2cp2-").items() if "moe" not in k}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ppcp") / "ppcp.json"
    return launch_cases(Path(__file__), 4, out)


@pytest.mark.parametrize("name", sorted(CASES))
def test_pp2_cp2_and_pp2_tp2_match_single_process_baseline_fp64(results, name):
    res = results[name]
    assert "error" not in res, res.get("error")
    assert res["n_params"] == res["n_params_ref"]
    bound = TREE_BOUND if "tree" in CASES[name] else BOUND
    assert res["grad_rel"] < bound, res
    assert res["loss_rel"] < bound, res
    if CASES[name]["system"] == "prefixflow" and CASES[name]["par"] == "cp":
        assert (
            res["cp_demand_gathers"] > 0 and res["cp_scatters"] > 0
        )  # the stage's prefix view is CP-gathered


def test_pp2_cp2_non_finite_loss_raises_on_every_rank_and_keeps_grads(results):
    res = results["pp2cp2-nanloss"]
    assert "error" not in res, res.get("error")
    assert_non_finite_refused(res, world=4)


def test_pp2_cp2_moe_is_refused_in_one_line_before_any_state_changes():
    """MoE under CP (routing plans cover whole sequences, not CP shards) is refused by parallelize, with or
    without PP, before the mesh or the model is touched; PP alone runs MoE (test_parallel_pp.py)."""
    from support.moe import tiny_moe

    from prefixflow.parallel import parallel_state, parallelize

    model = tiny_moe()
    before = [p.detach().clone() for p in model.parameters()]
    for dims in ({"pp": 2, "cp": 2}, {"cp": 2}):
        with pytest.raises(ValueError, match=r"^cp=2 with MoE layers is not supported yet") as err:
            parallelize(model, dims)
        assert "\n" not in str(err.value)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert parallel_state(model) is None


if __name__ == "__main__":
    cases = {name: (lambda spec=spec: run_pp_case(spec, **{spec["par"]: 2})) for name, spec in CASES.items()}
    run_worker(
        {**cases, **DRIFT},
        sys.argv[1],
        sys.argv[2:],
    )
