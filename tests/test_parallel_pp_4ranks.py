"""PP2 x CP2 and PP2 x TP2 on 4 ranks: fp64 against the single-process baseline, one torchrun.

Under CP each stage shards its prefix and every microbatch over its CP pair and activations cross stages as
CP shards; under TP each stage runs TorchTitan's plan and activations cross stages sequence-sharded.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _torchrun_cases import launch_cases, run_worker
from test_parallel_pp import BOUND, run_pp_case


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
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ppcp") / "ppcp.json"
    return launch_cases(Path(__file__), 4, out)


@pytest.mark.parametrize("name", sorted(CASES))
def test_pp2_cp2_and_pp2_tp2_match_single_process_baseline_fp64(results, name):
    res = results[name]
    assert "error" not in res, res.get("error")
    assert res["n_params"] == res["n_params_ref"]
    assert res["grad_rel"] < BOUND, res
    assert res["loss_rel"] < BOUND, res
    if CASES[name]["system"] == "prefixflow" and CASES[name]["par"] == "cp":
        assert (
            res["cp_demand_gathers"] > 0 and res["cp_scatters"] > 0
        )  # the stage's prefix view is CP-gathered


if __name__ == "__main__":
    run_worker(
        {name: (lambda spec=spec: run_pp_case(spec, **{spec["par"]: 2})) for name, spec in CASES.items()},
        sys.argv[1],
        sys.argv[2:],
    )
