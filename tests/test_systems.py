"""Every registered harness system trains the same objective: equal loss and gradients (fp64)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from _reference import max_rel_diff
from conftest import TINY

import prefixflow as pf
from harness.systems import available_systems, get_system


def test_registered_systems_agree_with_the_baseline():
    assert {"baseline", "prefixflow", "prefixflow_split", "prefix_grouper"} <= set(available_systems())
    name, overrides = TINY["qwen3"]
    group = pf.synthetic_group(97, 17, [4, 9, 2], seed=3)
    cell = SimpleNamespace(layout="packed", microbatch=2, loss="pg", offload=False)
    results = {}
    for system_name in ("baseline", "prefixflow", "prefixflow_split", "prefix_grouper"):
        system = get_system(system_name)
        model = system.prepare(pf.build_model(name, dtype=torch.float64, overrides=overrides), cell)
        stats = system.step(model, group, cell, None)
        results[system_name] = (stats.loss, [p.grad for p in model.parameters()])
    want_loss, want = results.pop("baseline")
    for system_name, (loss, grads) in results.items():
        assert abs(loss - want_loss) < 1e-12, system_name
        assert max_rel_diff(grads, want) < 1e-12, system_name
    split = get_system("prefixflow_split").prepare(pf.build_model(name, overrides=overrides), cell)
    assert split._prefixflow.config.attention == "split"
