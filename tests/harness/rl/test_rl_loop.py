"""Claim 2's closed loop: KV-cached sampling, GRPO pieces, a deterministic 3-step loop per trainer, resume."""

from __future__ import annotations

import math

import pytest
import torch
from support.rl_tiny import TINY_SPEC, tiny_spec

import prefixflow as pf
from harness.records import read_records
from harness.rl.loop import ClosedLoop, RunPlan, build_model_for, task_of
from harness.rl.run import run_claim2
from harness.rl.task import EOS, RetrievalTask, warm_start
from prefixflow.rl import (
    actor_update,
    group_advantages,
    response_logprobs,
    sample_responses,
    sync_weights,
)

TIMING = (
    "generation_s",
    "reward_s",
    "evaluation_s",
    "update_s",
    "sync_s",
    "step_s",
    "update_train_s",
    "update_optimizer_s",
)


def _model(dtype=torch.float64, seed=0):
    m = pf.build_model("llama3:debugmodel", dtype=dtype, seed=seed,
                       overrides={"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 61,
                                  "max_seq_len": 128})  # fmt: skip
    return pf.apply_prefixflow(m)


def test_kv_cached_greedy_equals_full_recompute():
    m = _model()
    prompt = torch.randint(0, 61, (23,), generator=torch.Generator().manual_seed(1))
    ro = sample_responses(m, prompt, 3, max_new_tokens=7, eos_id=999 % 61, temperature=0)
    seq = prompt.clone()
    with torch.no_grad():
        for _ in range(len(ro.responses[0])):
            seq = torch.cat([seq, m(seq.unsqueeze(0))[0, -1].argmax().view(1)])
    assert all(torch.equal(r, seq[23:]) for r in ro.responses)  # greedy: every row identical


def test_sampler_logprobs_match_evaluation_and_stop_at_eos():
    m = _model()
    prompt = torch.randint(0, 61, (17,), generator=torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(3)
    ro = sample_responses(m, prompt, 6, max_new_tokens=9, eos_id=5, generator=gen)
    ev = response_logprobs(m, prompt, ro.responses)
    for r, lp, e, cut in zip(ro.responses, ro.logprobs, ev, ro.truncated, strict=True):
        assert torch.allclose(lp.double(), e.double(), atol=1e-6)
        assert (5 not in r[:-1].tolist()) and (cut == (r[-1] != 5 and len(r) == 9))


def test_sampler_draws_from_softmax_over_temperature():
    m = _model(torch.float32)
    prompt = torch.randint(0, 61, (9,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits = m(prompt.unsqueeze(0))[0, -1].double()
    n = 20_000
    for temperature in (1.0, 0.5):
        ro = sample_responses(m, prompt, n, max_new_tokens=1, eos_id=0, temperature=temperature,
                              generator=torch.Generator().manual_seed(5))  # fmt: skip
        counts = torch.bincount(torch.stack(ro.responses).flatten(), minlength=61).double()
        probs = torch.softmax(logits / temperature, dim=-1)
        top = probs.argsort(descending=True)[:5]
        for t in top:  # binomial standard error on the most likely tokens
            se = math.sqrt(probs[t] * (1 - probs[t]) / n)
            assert abs(counts[t] / n - probs[t]) < 5 * se + 1e-4


def test_group_advantages():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]))
    assert abs(float(adv.mean())) < 1e-12 and abs(float(adv.std()) - 1) < 1e-5
    assert torch.equal(group_advantages(torch.tensor([0.3, 0.3])), torch.zeros(2))
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([1.0, float("nan")]))


def test_a_bad_group_leaves_gradients_learning_rate_and_weights_as_they_were():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    good = pf.RolloutGroup(
        torch.arange(1, 9), [torch.tensor([3, 4]), torch.tensor([5])], torch.tensor([1.0, -1])
    )
    bad = pf.RolloutGroup(
        torch.arange(1, 9), [torch.tensor([3, 99])], torch.tensor([1.0])
    )  # id 99 >= vocab 61
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"responses\[0\] has token id 99 outside"):
        actor_update(model, [good, bad], opt, system="prefixflow", lr=1e-3)
    assert opt.param_groups[0]["lr"] == 0.5 and not opt.state
    assert all(torch.equal(p.grad, torch.full_like(p, 0.25)) for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_a_non_finite_gradient_in_any_group_undoes_the_whole_update(monkeypatch):
    import prefixflow.schedule.grad_guard as guard

    checks = []
    real = guard.all_finite
    monkeypatch.setattr(guard, "all_finite", lambda ts: checks.append(1) or real(ts))
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    groups = [
        pf.RolloutGroup(torch.arange(1, 9), [torch.tensor([3, 4]), torch.tensor([5])], torch.tensor([a, -a]))
        for a in (1.0, 2.0, 0.5)
    ]
    actor_update(model, groups, opt, system="prefixflow", lr=1e-3)
    assert checks == [1]  # one finiteness check for the three groups (train_group's guard nests)
    calls = []  # the second group's Phase B backward (finite loss) leaves an inf in one weight's gradient
    weight = model.tok_embeddings.weight
    weight.register_hook(lambda g: calls.append(1) or (g * math.inf if len(calls) == 3 else g))
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: v["exp_avg"].clone() for k, v in opt.state.items()}
    with pytest.raises(pf.NonFiniteError, match=r"gradient of tok_embeddings\.weight is not finite"):
        actor_update(model, groups, opt, system="prefixflow", lr=1e-4)
    assert len(calls) == 6 and opt.param_groups[0]["lr"] == 1e-3  # Phases B and C per group; lr as it was
    assert all(torch.equal(p.grad, torch.full_like(p, 0.25)) for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(torch.equal(opt.state[k]["exp_avg"], v) for k, v in state.items())


def test_sync_weights_copies_and_casts():
    src, dst = _model(torch.float32, seed=0), _model(torch.bfloat16, seed=1)
    written = sync_weights(src, dst)
    for (_, p), (_, q) in zip(src.named_parameters(), dst.named_parameters(), strict=True):
        assert torch.equal(p.to(torch.bfloat16), q)
    assert written == sum(p.numel() * 2 for p in dst.parameters())


def test_task_answer_is_in_prompt_and_reward():
    task = RetrievalTask.for_prefix_ratio(0.95, 4)
    assert abs(task.prefix_ratio - 0.95) < 0.01 and task.prompt_len == 93
    prompt, answer = task.example(0, 7)
    assert prompt.numel() == task.prompt_len and int(prompt.max()) < task.vocab_size
    key = int(prompt[-1])
    start = (prompt[:-2] == key).nonzero().flatten().tolist()
    assert len(start) == 1 and torch.equal(prompt[start[0] + 1 : start[0] + 5], answer)
    assert task.reward(torch.cat([answer, torch.tensor([EOS])]), answer) == 1.0
    assert task.reward(torch.cat([answer[:2], torch.tensor([EOS])]), answer) == 0.5
    assert task.reward(torch.cat([answer, answer[:1]]), answer) == 0.8  # no EOS: extra token costs


_WARM = {}


def _init(spec):
    """A 40-step supervised warm start (as the multi-rank loop tests' spec): rewards then vary within a group
    and the weights move from the first step on any torch. From random weights they depended on the
    initialisation's draws, which torch 2.11 and 2.13 make differently (``trunc_normal_``)."""
    key = spec.model_dump_json()
    if key not in _WARM:
        task = task_of(spec)
        model = build_model_for(spec, task, torch.float32, torch.device("cpu"))
        warm_start(model, task, steps=40, batch=8, lr=3e-3, seed=0)
        _WARM[key] = {k: v.detach().clone() for k, v in model.named_parameters()}
    return _WARM[key]


@pytest.mark.parametrize("system", ["baseline", "prefixflow"])
def test_three_step_loop_is_deterministic(system):
    spec = tiny_spec()
    task, init = task_of(spec), _init(spec)
    plan = RunPlan(system, system, 0, "fp32", 3, "compare")
    runs = []
    for _ in range(2):
        loop = ClosedLoop(spec, task, plan, init, "cpu")
        records = [loop.step()[0] for _ in range(3)]
        runs.append((records, {k: v.clone() for k, v in loop.actor.named_parameters()}))
    (rec_a, w_a), (rec_b, w_b) = runs
    for a, b in zip(rec_a, rec_b, strict=True):
        assert {k: v for k, v in a.items() if k not in TIMING and not k.startswith("phase_")} == {
            k: v for k, v in b.items() if k not in TIMING and not k.startswith("phase_")
        }
    assert all(torch.equal(w_a[k], w_b[k]) for k in w_a)
    assert rec_a[-1]["drift_rms"] > 0  # the loop trains


def test_trainers_agree_in_fp32_and_fork_under_another_seed():
    spec = tiny_spec()
    task, init = task_of(spec), _init(spec)
    out = {}
    for name, system, seed in (("b0", "baseline", 0), ("p0", "prefixflow", 0), ("b1", "baseline", 1)):
        loop = ClosedLoop(spec, task, RunPlan(name, system, seed, "fp32", 3, "compare"), init, "cpu")
        rec = [loop.step()[0] for _ in range(3)]
        out[name] = (rec, torch.cat([p.detach().flatten() for p in loop.actor.parameters()]))
    (rb, wb), (rp, wp), (_, w1) = out["b0"], out["p0"], out["b1"]
    assert [r["reward_mean"] for r in rb] == [r["reward_mean"] for r in rp]  # same samples
    assert float((wb - wp).abs().max()) < 1e-5
    assert float((wb - w1).abs().max()) > 1e-4  # a seed change is a different run


def test_resume_reproduces_an_uninterrupted_run(tmp_path, monkeypatch):
    spec = tiny_spec(loop={**TINY_SPEC["loop"], "steps": 4}, checkpoint_every=2, trainers=["baseline"])
    clean = run_claim2(spec, None, tmp_path / "clean", log=lambda _: None)
    original = ClosedLoop.step
    calls = {"n": 0}

    def dies_at_step_3(self):
        if self.step_done == 2 and calls["n"] == 0:
            calls["n"] += 1
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(ClosedLoop, "step", dies_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        run_claim2(spec, None, tmp_path / "resumed", log=lambda _: None)
    resumed = run_claim2(spec, None, tmp_path / "resumed", log=lambda _: None)
    a = read_records(clean / "records" / "baseline-s0.parquet")
    b = read_records(resumed / "records" / "baseline-s0.parquet")
    cols = ["step", "reward_mean", "loss", "grad_norm", "drift_rms", "response_tokens"]
    assert a[cols].equals(b[cols]) and list(a["step"]) == [1, 2, 3, 4]


def test_sequential_schedule_gives_the_lockstep_numbers_and_frees_each_run(tmp_path, monkeypatch):
    import harness.rl.run as rl_run

    spec = tiny_spec(reference_seed=1, claim3_reference={"enabled": True, "warmup": 0, "repeats": 1})
    lockstep = run_claim2(spec, None, tmp_path / "lockstep", log=lambda _: None)
    built, released = [], []
    original_init, original_release = rl_run._Run.__init__, rl_run._Run.release

    def init(self, *a, **k):
        assert len(built) == len(released), "a run was built while another still held its models"
        built.append(a[2].name)
        original_init(self, *a, **k)

    def release(self):
        released.append(self.plan.name)
        original_release(self)
        assert self.loop.actor is None and self.loop.rollout is None and self.loop.optimizer is None

    monkeypatch.setattr(rl_run._Run, "__init__", init)
    monkeypatch.setattr(rl_run._Run, "release", release)
    sequential = run_claim2(
        spec.model_copy(update={"schedule": "sequential"}), None, tmp_path / "seq", log=print
    )
    assert built == released == [p.name for p in rl_run.plans_of(spec)] and len(built) == 4
    cols = ["step", "reward_mean", "loss", "grad_norm", "drift_rms", "response_tokens"]
    for run in built:
        a = read_records(lockstep / "records" / f"{run}.parquet")
        b = read_records(sequential / "records" / f"{run}.parquet")
        assert a[cols].equals(b[cols]), run
    ref = read_records(sequential / "claim3-reference.parquet")  # at every checkpoint, after the runs
    assert sorted(set(ref["step"])) == [1, 2, 3]
    assert read_records(sequential / "divergence.parquet")[["run", "step", "rmse"]].equals(
        read_records(lockstep / "divergence.parquet")[["run", "step", "rmse"]]
    )
