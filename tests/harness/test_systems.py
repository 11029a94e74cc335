"""Every registered harness system trains the same objective: equal loss and gradients (fp64); the names match
the library (``prefixflow`` is its default, the explicit variants pin one attention implementation)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from conftest import TINY
from support.reference import max_rel_diff

import prefixflow as pf
from harness.contenders import available_contenders, get_contender

PREFIXFLOW = ("prefixflow", "prefixflow_concat", "prefixflow_split")


def test_registered_systems_agree_with_the_baseline():
    assert {"baseline", *PREFIXFLOW, "prefix_grouper"} <= set(available_contenders())
    name, overrides = TINY["qwen3"]
    group = pf.synthetic_group(97, 17, [4, 9, 2], seed=3)
    cell = SimpleNamespace(layout="packed", microbatch=2, loss="pg", offload=False)
    results = {}
    for system_name in ("baseline", *PREFIXFLOW, "prefix_grouper"):
        system = get_contender(system_name)
        model = system.prepare(pf.build_model(name, dtype=torch.float64, overrides=overrides), cell)
        stats = system.step(model, [group], cell, None)
        results[system_name] = (stats.loss, [p.grad for p in model.parameters()])
    want_loss, want = results.pop("baseline")
    for system_name, (loss, grads) in results.items():
        assert abs(loss - want_loss) < 1e-12, system_name
        assert max_rel_diff(grads, want) < 1e-12, system_name


def test_names_match_the_library():
    """`prefixflow` runs what `train_group` runs by default (attention="auto"); the variants pin theirs."""
    name, overrides = TINY["llama3"]
    cell = SimpleNamespace(layout="padded", microbatch=1, loss="pg", offload=False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    default = pf.PrefixFlowConfig()
    for system_name, attention in zip(PREFIXFLOW, ("auto", "concat", "split"), strict=True):
        system = get_contender(system_name)
        model = system.prepare(pf.build_model(name, overrides=overrides), cell)
        assert model._prefixflow.config.attention == attention, system_name
        want = default.attention_for if attention == "auto" else (lambda d, a=attention: a)
        assert system.attention_variant(cpu) == want(cpu) and system.attention_variant(cuda) == want(cuda)
    assert get_contender("baseline").attention_variant(cpu) is None
    assert get_contender("prefix_grouper").attention_variant(cpu) is None
