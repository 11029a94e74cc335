"""Schedule hooks (prefixflow.hooks): where parallelism and MoE enter the phases."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import tiny_model

import prefixflow as pf


class Recorder(pf.ScheduleHooks):
    def __init__(self, name: str, log: list, fail_in: str | None = None) -> None:
        self.name, self.log, self.fail_in = name, log, fail_in

    def check(self, model, group, system):
        self.log.append((self.name, "check", system))
        if self.fail_in == "check":
            raise ValueError("group.bogus: rejected by the hook")

    @contextlib.contextmanager
    def group(self, model, group, system):
        self.log.append((self.name, "group+", system))
        try:
            yield
        finally:
            self.log.append((self.name, "group-", system))

    @contextlib.contextmanager
    def phase(self, name):
        self.log.append((self.name, "phase+", name))
        yield
        self.log.append((self.name, "phase-", name))

    @contextlib.contextmanager
    def microbatch(self, mb):
        self.log.append((self.name, "mb", mb.responses, mb.cached_keys))
        if self.fail_in == "microbatch":
            raise RuntimeError("injected")
        yield


def _group(seed: int = 0) -> pf.RolloutGroup:
    return pf.synthetic_group(97, 12, [5, 7, 3], seed=seed)


@pytest.mark.parametrize("system", ["prefixflow", "baseline"])
def test_hooks_wrap_group_phases_and_microbatches_in_stack_order(system):
    model = tiny_model("llama3")
    log: list = []
    pf.add_hooks(model, Recorder("outer", log))
    pf.add_hooks(model, Recorder("inner", log))
    pf.train_group(model, _group(), system=system, microbatch=2)
    names = [e for e in log if e[0] == "outer"]
    phases = ["A", "B", "C"] if system == "prefixflow" else ["full"]
    assert [e[2] for e in names if e[1] == "phase+"] == phases
    mbs = [e for e in names if e[1] == "mb"]
    if system == "prefixflow":  # the cached prefix's row (its forward, then its backward), the leaf rows
        node = ("outer", "mb", (-1,), 0)
        assert mbs == [node, ("outer", "mb", (0, 1), 11), ("outer", "mb", (2,), 11), node]
    else:
        assert mbs == [("outer", "mb", (0, 1), 0), ("outer", "mb", (2,), 0)]
    # A stack: outer enters first and exits last.
    assert log[0][:2] == ("outer", "check") and log[2][:2] == ("outer", "group+")
    assert log[-1][:2] == ("outer", "group-") and log[-2][:2] == ("inner", "group-")


def test_hook_check_rejects_before_any_gradient_changes():
    model = tiny_model("qwen3")
    pf.train_group(model, _group(1))
    before = [p.grad.clone() for p in model.parameters()]
    log: list = []
    pf.add_hooks(model, Recorder("h", log, fail_in="check"))
    with pytest.raises(ValueError, match="group.bogus"):
        pf.train_group(model, _group(2))
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))
    assert [e[1] for e in log] == ["check"]


def test_hook_group_exit_runs_on_error_and_remove_hooks_unregisters():
    model = tiny_model("llama3")
    log: list = []
    hook = pf.add_hooks(model, Recorder("h", log, fail_in="microbatch"))
    with pytest.raises(RuntimeError, match="injected"):
        pf.train_group(model, _group())
    assert log[-1][:2] == ("h", "group-")
    with pytest.raises(ValueError, match="already registered"):
        pf.add_hooks(model, hook)
    pf.remove_hooks(model, hook)
    log.clear()
    pf.train_group(model, _group())
    assert log == []
    with pytest.raises(TypeError, match="ScheduleHooks"):
        pf.add_hooks(model, object())
