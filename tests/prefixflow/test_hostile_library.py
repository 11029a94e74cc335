"""Hostile input to the library (issue 14, break 10): param.grad never receives NaN/inf, a failing call
leaves the gradients from before it, and complex or meta tensors are rejected by field name."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_model

import prefixflow as pf
from prefixflow.schedule.grad_guard import NonFiniteError, all_finite, keep_grads_on_failure

P, LENS = 10, [5, 7, 4]


def _group(adv=(0.5, -1.0, 1.2), with_logprobs=False, **over) -> pf.RolloutGroup:
    g = pf.synthetic_group(97, P, LENS, seed=1, with_logprobs=with_logprobs)
    fields = dict(prompt=g.prompt, responses=g.responses, advantages=torch.tensor(adv, dtype=torch.float64))
    fields.update(old_logprobs=g.old_logprobs, ref_logprobs=g.ref_logprobs)
    fields.update(over)
    return pf.RolloutGroup(**fields)


def _grads(model) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _same(a, b) -> bool:
    return all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b, strict=True)
    )


@pytest.fixture(scope="module")
def fp32_model():
    return tiny_model("llama3", dtype=torch.float32)


@pytest.fixture
def warm(fp32_model):
    """The model with gradients from an earlier, good call (what a failing call must keep)."""
    fp32_model.zero_grad(set_to_none=True)
    pf.train_group(fp32_model, _group(), system="baseline")
    return fp32_model, _grads(fp32_model)


@pytest.mark.parametrize("system", ["prefixflow", "baseline"])
def test_advantages_that_overflow_the_compute_dtype_are_rejected(warm, system):
    model, before = warm
    for adv in ((1e308, 0.0, 1.0), (0.0, -1e39, 1.0)):  # finite in fp64, inf in fp32 (the loss's dtype)
        with pytest.raises(ValueError, match=r"advantages holds .*overflows torch\.float32"):
            pf.train_group(model, _group(adv=adv), system=system)
    with pytest.raises(ValueError, match=r"old_logprobs\[1\] holds .*overflows"):
        bad = _group(with_logprobs=True)
        bad.old_logprobs[1][2] = -1e300
        pf.train_group(model, bad, system=system, loss="grpo")
    assert _same(_grads(model), before)


@pytest.mark.parametrize(
    "config",
    [{"kl_coef": math.inf}, {"kl_coef": math.nan}, {"clip_eps_high": math.inf}, {"clip_eps_low": -math.inf}],
)
def test_non_finite_loss_config_is_rejected(warm, config):
    model, before = warm
    name = next(iter(config))
    with pytest.raises(ValueError, match=rf"loss_config\.{name} must be a finite number"):
        pf.train_group(model, _group(with_logprobs=True), loss="grpo", loss_config=config)
    assert _same(_grads(model), before)


@pytest.mark.parametrize("system", ["prefixflow", "baseline"])
def test_non_finite_microbatch_loss_raises_before_its_backward_and_keeps_earlier_grads(warm, system):
    model, before = warm
    # finite in fp32, but -A * log p overflows: the second microbatch's loss is inf. The first microbatch's
    # backward has already run when it fails; its share must not stay in param.grad.
    group = _group(adv=(0.5, 3e38, 1.0))
    with pytest.raises(NonFiniteError, match=r"microbatch of responses \[1\] has a non-finite loss"):
        pf.train_group(model, group, system=system, microbatch=1)
    assert _same(_grads(model), before)
    # nothing survives the failed call: the next group trains exactly as on a fresh model
    pf.train_group(model, _group(), system=system)
    model.zero_grad(set_to_none=True)
    pf.train_group(model, _group(), system=system)
    once = _grads(model)
    model.zero_grad(set_to_none=True)
    with pytest.raises(NonFiniteError):
        pf.train_group(model, group, system=system, microbatch=1)
    assert all(g is None for g in _grads(model))  # no gradient before the call: none after it
    pf.train_group(model, _group(), system=system)
    assert _same(_grads(model), once)


def test_a_successful_call_still_accumulates(warm):
    model, before = warm
    pf.train_group(model, _group(), system="baseline")
    after = _grads(model)
    assert all(
        torch.allclose(a, 2 * b, rtol=1e-5, atol=1e-7)
        for a, b in zip(after, before, strict=True)
        if b is not None
    )


def test_non_finite_gradient_is_never_merged():
    lin = torch.nn.Linear(3, 2)
    lin(torch.ones(1, 3)).sum().backward()
    before = _grads(lin)
    with pytest.raises(NonFiniteError, match="gradient of weight is not finite"):
        with keep_grads_on_failure(lin):
            (lin(torch.ones(1, 3)).sum() * torch.tensor(float("inf"))).backward()
    assert _same(_grads(lin), before)
    with pytest.raises(RuntimeError, match="boom"):  # any failure restores them, too
        with keep_grads_on_failure(lin):
            lin(torch.ones(1, 3)).sum().backward()
            raise RuntimeError("boom")
    assert _same(_grads(lin), before)


def test_nested_guards_check_and_merge_once_for_the_outermost(monkeypatch):
    import prefixflow.schedule.grad_guard as guard

    checks = []
    monkeypatch.setattr(guard, "all_finite", lambda ts: checks.append(len(ts)) or all_finite(ts))
    lin = torch.nn.Linear(3, 2)
    lin(torch.ones(1, 3)).sum().backward()
    before = _grads(lin)
    with keep_grads_on_failure(lin):
        for _ in range(2):
            with keep_grads_on_failure(lin):
                lin(torch.ones(1, 3)).sum().backward()
    assert checks == [2]  # weight and bias, checked once
    assert all(torch.allclose(g, 3 * b) for g, b in zip(_grads(lin), before, strict=True))
    lin.zero_grad(set_to_none=True)
    lin(torch.ones(1, 3)).sum().backward()
    checks.clear()
    with pytest.raises(NonFiniteError, match="gradient of weight is not finite"):
        with keep_grads_on_failure(lin):
            with keep_grads_on_failure(lin):  # a no-op inside: its bad gradient is caught by the outer one
                (lin(torch.ones(1, 3)).sum() * torch.tensor(float("inf"))).backward()
            with keep_grads_on_failure(lin):
                lin(torch.ones(1, 3)).sum().backward()
    assert checks == [2] and _same(_grads(lin), before)
    checks.clear()
    with keep_grads_on_failure(lin):  # the failure left no guard marked active: this one acts again
        lin(torch.ones(1, 3)).sum().backward()
    assert checks == [2]
    assert all(torch.allclose(g, 2 * b) for g, b in zip(_grads(lin), before, strict=True))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_all_finite_finds_any_non_finite_value(bad, dtype):
    grads = [
        torch.zeros(0, dtype=dtype),
        torch.full((3, 4), 1e308 if dtype == torch.float64 else 3e38, dtype=dtype),
    ]
    grads += [torch.randn(5, 6).to(dtype)]
    assert all_finite(grads)  # huge but finite values, and an empty tensor, are not flagged
    grads[-1][2, 3] = bad
    assert not all_finite(grads)


@pytest.mark.parametrize(
    "over, error, match",
    [
        (
            {"advantages": torch.tensor([1 + 1j, 0j, 1j])},
            TypeError,
            r"advantages must be real numbers.*complex",
        ),
        (
            {"advantages": torch.tensor([True, False, True])},
            TypeError,
            r"advantages must be real numbers.*bool",
        ),
        ({"advantages": torch.empty(3, device="meta")}, ValueError, r"advantages is on the meta device"),
        (
            {"prompt": torch.empty(P, dtype=torch.long, device="meta")},
            ValueError,
            r"prompt is on the meta device",
        ),
        ({"advantages": ["a", "b", "c"]}, TypeError, r"advantages must be a real tensor"),
    ],
    ids=["complex-adv", "bool-adv", "meta-adv", "meta-prompt", "str-adv"],
)
def test_complex_bool_and_meta_inputs_are_rejected_by_field(over, error, match):
    with pytest.raises(error, match=match):
        _group(**over)


def test_meta_response_and_complex_logprobs_are_rejected_by_field():
    g = _group(with_logprobs=True)
    responses = list(g.responses)
    responses[1] = torch.empty(LENS[1], dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match=r"responses\[1\] is on the meta device"):
        _group(responses=responses)
    old = [lp.to(torch.complex128) if i == 2 else lp for i, lp in enumerate(g.old_logprobs)]
    with pytest.raises(TypeError, match=r"old_logprobs\[2\] must be a real floating tensor"):
        _group(with_logprobs=True, old_logprobs=old)
    ref = [lp.to("meta") if i == 0 else lp for i, lp in enumerate(g.ref_logprobs)]
    with pytest.raises(ValueError, match=r"ref_logprobs\[0\] is on the meta device"):
        _group(with_logprobs=True, ref_logprobs=ref)
