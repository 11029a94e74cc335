"""microbatch="auto" (prefixflow.memory.budget): the largest suffix microbatches that fit a memory budget, measured."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from support.reference import max_rel_diff

import prefixflow as pf
from harness.run.measure import PhaseMeter

GROUP = dict(vocab_size=97, prompt_len=60, response_lens=[12] * 10)


def _peak(model, group, **kwargs):
    """(peak live bytes of the step as the harness meters it, GroupStats, gradients)."""
    model.zero_grad(set_to_none=True)
    meter = PhaseMeter("cpu", model=model)
    with meter:
        stats = pf.train_group(model, group, observer=meter, **kwargs)
    grads = [p.grad.detach().clone() for p in model.parameters()]
    return meter.results()["peak_mem_bytes"], stats, grads


@pytest.mark.parametrize(
    "system,layout", [("prefixflow", "padded"), ("prefixflow", "packed"), ("baseline", "padded")]
)
def test_auto_fills_the_budget_without_exceeding_it(system, layout):
    model = tiny_model("llama3")
    group = pf.synthetic_group(**GROUP, seed=1)
    one, _, want = _peak(model, group, system=system, layout=layout, microbatch=1)
    four, _, _ = _peak(model, group, system=system, layout=layout, microbatch=4)
    budget = int(four)  # room for about four responses per microbatch
    pf.apply_prefixflow(model, pf.PrefixFlowConfig(memory_budget_bytes=budget))
    peak, stats, got = _peak(model, group, system=system, layout=layout, microbatch="auto")
    sizes = stats.plan["microbatch_sizes"]
    assert sizes[:2] == (1, 1) and sum(sizes) == group.n and max(sizes) >= 3, stats.plan
    assert stats.n_microbatches == len(sizes) and stats.plan["probe_fits"]
    assert peak <= budget, (peak, budget, stats.plan)
    assert one < peak  # it spent the budget on larger microbatches
    assert max_rel_diff(got, want) < 1e-12  # same gradients as any other microbatching (fp64)


def test_a_budget_below_one_response_runs_one_at_a_time():
    """... and says so (issue 26, defect 9: it ran over the budget silently)."""
    from prefixflow.memory.budget import OverBudgetWarning

    model = pf.apply_prefixflow(tiny_model("llama3"), pf.PrefixFlowConfig(memory_budget_bytes=1))
    with pytest.warns(
        OverBudgetWarning, match=r"one response needs about .* more than memory_budget_bytes=1"
    ):
        stats = pf.train_group(model, pf.synthetic_group(**GROUP, seed=2), microbatch="auto")
    assert stats.plan["microbatch_sizes"] == (1,) * 10 and stats.plan["probe_fits"] is False


def test_auto_is_validated():
    model = tiny_model("llama3")
    group = pf.synthetic_group(**GROUP, seed=3)
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        pf.train_group(model, group, microbatch="auto")
    with pytest.raises(ValueError, match="microbatch"):
        pf.train_group(model, group, microbatch="largest")
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        pf.PrefixFlowConfig(memory_budget_bytes=0)
    pf.apply_prefixflow(model, pf.PrefixFlowConfig(memory_budget_bytes=1 << 30))
    pf.apply_compile(model)
    with pytest.raises(ValueError, match="compiled"):
        pf.train_group(model, group, microbatch="auto")
    assert all(p.grad is None for p in model.parameters())  # rejected before any gradient changed
    assert torch.is_grad_enabled()
