"""The multi-turn GRPO loop (issue 22 item 5): the tool task, the three trainers' equal objective in fp64, tree
traces (loss masks validated as untrusted data), the spec's task kind, and the multiturn-smoke pipeline."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import prefixflow as pf
from harness.records import read_records
from harness.rl.io import TraceError
from harness.rl.multiturn import CALL, ERROR, MultiTurnTask
from harness.rl.run import run_claim2
from harness.rl.spec import load_rl_spec, parse_rl_spec
from harness.rl.trace import _group, load_trace
from harness.rl.trainers import group_tree, trainer_inputs
from harness.spec.load import SpecError
from prefixflow.rl import group_advantages, response_logprobs

SPEC = Path(__file__).resolve().parents[3] / "experiments" / "claim2.yaml"
TASK = MultiTurnTask(
    system_len=6, note_len=3, fields=2, value_len=2, n_keys=4, choices=3, calls=2, reply_text=20
)


def _model(seed=0):
    m = pf.build_model("llama3:debugmodel", dtype=torch.float64, seed=seed,
                       overrides={"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                                  "vocab_size": TASK.vocab_size, "max_seq_len": 128})  # fmt: skip
    return pf.apply_prefixflow(m)


def _group_of(model, seed=0):
    """A sampled multi-turn group (2 calls x 3 answers) with advantages and old log-probs."""
    ep = TASK.example(7, seed)
    gen = torch.Generator().manual_seed(seed)
    ro = TASK.rollout(model, ep, 3, max_new_tokens=8, temperature=1.0, generator=gen)
    rewards = torch.tensor([TASK.reward(a, ep) for a in ro.answers], dtype=torch.float64)
    adv = group_advantages(rewards + torch.linspace(0, 1, len(rewards), dtype=torch.float64))
    old = [lp + 0.05 for lp in response_logprobs(model, ep.prompt, ro.responses)]
    return pf.RolloutGroup(ep.prompt, ro.responses, adv, old, None, loss_masks=ro.loss_masks), ro


def _well_formed_group(model, seed=0):
    """2 well-formed calls (distinct notes) x 3 answers of different lengths: the tree a trained policy samples."""
    ep = TASK.example(7, seed)
    gen = torch.Generator().manual_seed(seed)
    p, tail = ep.prompt.numel(), TASK.value_len + 1
    responses, masks = [], []
    for _ in range(TASK.calls):
        seq, mask = TASK.episode_tokens(ep, gen)
        for a in range(3):
            answer = torch.randint(TASK._value0, TASK.vocab_size, (1 + a,), generator=gen)
            responses.append(torch.cat([seq[p:-tail], answer, torch.tensor([2])]))
            masks.append(torch.cat([mask[p:-tail], torch.ones(2 + a, dtype=torch.bool)]))
    adv = group_advantages(torch.randn(len(responses), generator=gen, dtype=torch.float64))
    old = [lp + 0.05 for lp in response_logprobs(model, ep.prompt, responses)]
    return pf.RolloutGroup(ep.prompt, responses, adv, old, None, loss_masks=masks)


def test_tool_reward_and_rollout_shape():
    ep = TASK.example(3, 1)
    right = torch.cat([torch.tensor([TASK._note0] * TASK.note_len), TASK.call_of(ep)])
    reply = TASK.tool(ep, right)
    assert reply[-TASK.value_len - 1 : -1].tolist() == ep.answer.tolist()  # the tool returns the asked value
    assert TASK.tool(ep, right[:-1]).tolist()[1] == ERROR  # no CALL at the end: an error reply
    assert TASK.tool(ep, torch.tensor([TASK._key0, CALL])).tolist()[1] == ERROR
    assert TASK.reward(ep.answer, ep) == 1.0 and TASK.reward(torch.tensor([2]), ep) == 0.0
    other = TASK.example(3, 2)
    assert not torch.equal(other.values, ep.values)  # the table is per question: only the tool knows it
    group, ro = _group_of(_model())
    assert group.n == TASK.calls * 3 and all(0.0 <= TASK.reward(a, ep) <= 1.0 for a in ro.answers)
    for resp, mask, ans in zip(ro.responses, ro.loss_masks, ro.answers, strict=True):
        assert int((~mask).sum()) in (3, TASK.reply_len)  # exactly the tool reply is masked
        assert torch.equal(resp[-ans.numel() :], ans) and bool(mask[-ans.numel() :].all())


def test_three_trainers_same_loss_and_gradients_fp64():
    model = _model()
    group = _well_formed_group(model)
    tree = group_tree(group)
    assert tree.n_nodes >= 1 + TASK.calls + group.n  # prompt -> one node per call -> answers: a real tree
    auto = trainer_inputs("prefixflow_tree", [group])[1][0]
    assert auto.n_nodes > 1 + group.n  # the call nodes pay their cost: the auto rule keeps them split
    results = {}
    for trainer in ("baseline", "prefixflow", "prefixflow_tree"):
        system, inputs = trainer_inputs(trainer, [group])
        model.zero_grad(set_to_none=True)
        stats = pf.train_group(model, inputs[0], system=system, loss="grpo")
        results[trainer] = (stats.loss, {n: p.grad.clone() for n, p in model.named_parameters()})
    base_loss, base_grads = results["baseline"]
    assert base_loss != 0.0
    for trainer in ("prefixflow", "prefixflow_tree"):
        loss, grads = results[trainer]
        assert math.isclose(loss, base_loss, rel_tol=1e-12, abs_tol=1e-14), trainer
        for name, g in grads.items():
            torch.testing.assert_close(g, base_grads[name], rtol=1e-10, atol=1e-12, msg=f"{trainer} {name}")


def _trace_tensors(group):
    return {
        "g0.prompt": group.prompt,
        "g0.responses": torch.cat(group.responses),
        "g0.response_lens": torch.tensor(group.response_lens, dtype=torch.int64),
        "g0.advantages": group.advantages,
        "g0.old_logprobs": torch.cat(group.old_logprobs),
        "g0.loss_masks": torch.cat(group.loss_masks),
    }


def test_trace_loss_masks_round_trip_and_are_validated():
    group, _ = _group_of(_model())
    t = _trace_tensors(group)
    back = _group(t, 0, Path("step_00001.safetensors"))
    assert all(torch.equal(a, b) for a, b in zip(back.loss_masks, group.loss_masks, strict=True))
    bad = {
        "not bool": {**t, "g0.loss_masks": t["g0.loss_masks"].to(torch.uint8)},
        "holds": {**t, "g0.loss_masks": t["g0.loss_masks"][:-1]},
        "marks no token": {**t, "g0.loss_masks": torch.zeros_like(t["g0.loss_masks"])},
    }
    for words, tensors in bad.items():
        with pytest.raises(TraceError, match=words if words != "not bool" else "bool tensor"):
            _group(tensors, 0, Path("step_00001.safetensors"))


def test_spec_task_kind_errors_name_the_field():
    base = load_rl_spec(SPEC, "multiturn").model_dump(mode="json", exclude={"presets"})
    cases = {
        "is a multiturn field": {"task": {"kind": "retrieval", "calls": 2}},
        "multiple of task.calls": {"loop": {**base["loop"], "n": 7}},
        "needs task.kind: multiturn": {"task": {"kind": "retrieval"}},
        "claim3_reference.enabled": {"claim3_reference": {"enabled": True}},
        "task.kind": {"task": {**base["task"], "kind": "chat"}},
    }
    for words, change in cases.items():
        with pytest.raises(SpecError, match=words) as e:
            parse_rl_spec({**base, **change})
        assert len(str(e.value).splitlines()) == 2  # "<spec>: invalid spec" and the one field's line


def test_multiturn_smoke_pipeline(tmp_path):
    spec = load_rl_spec(SPEC, "multiturn-smoke")
    folder = run_claim2(spec, "multiturn-smoke", tmp_path, log=lambda _: None)
    runs = {s: read_records(folder / "records" / f"{s}-s0.parquet") for s in spec.trainers}
    for df in runs.values():
        assert df["reward_mean"].between(0, 1).all() and len(df) == spec.loop.steps
        assert (df["task_kind"] == "multiturn").all()
    # the same rollouts (shared seeds; step 1 precedes any update); both PrefixFlow trainers share work (the
    # tree's "auto" rule may merge these tiny nodes and compute more than flat: it weighs time, not tokens)
    first = {s: df.iloc[0] for s, df in runs.items()}
    assert len({(r["reward_mean"], r["path_tokens"]) for r in first.values()}) == 1
    computed = {s: r["computed_tokens"] for s, r in first.items()}
    assert (
        max(computed["prefixflow_tree"], computed["prefixflow"])
        < computed["baseline"]
        == first["baseline"]["path_tokens"]
    )
    trace = load_trace(folder / "_state" / "traces" / "baseline-bf16-s0")  # a tree trace: its masks came back
    groups = trace.groups(trace.manifest.steps[0])
    assert all(g.loss_masks is not None and not all(bool(m.all()) for m in g.loss_masks) for g in groups)
    for system in ("prefixflow_tree", "prefixflow"):
        rep = read_records(folder / f"replay-baseline-bf16-s0-{system}.parquet")
        assert len(rep) == spec.trace.steps and rep["max_abs"].map(math.isfinite).all()


def test_a_reply_that_fills_the_positions_gives_possible_advice():
    """Issue 36.7: task.reply_text 65536 advised lowering loop.max_new_tokens "to -32522 or less"."""
    from harness.rl.memory import check_rl_spec

    base = load_rl_spec(SPEC, "multiturn").model_dump(mode="json", exclude={"presets"})
    spec = parse_rl_spec({**base, "task": {**base["task"], "reply_text": 65536}})
    with pytest.raises(ValueError, match=r"leave no room for a policy turn; lower task.reply_text") as e:
        check_rl_spec(spec, 1, None)
    assert "or less" not in str(e.value) and "\n" not in str(e.value)
