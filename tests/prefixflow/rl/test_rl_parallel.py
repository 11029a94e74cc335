"""The GRPO trainer pieces (``prefixflow.rl``) on a parallel actor: TP2, CP2, FSDP2 and DP against one
process, fp64.

One launch of 2 local ranks. Per layout and system, every rank evaluates response log-probs with the
parallelized actor, takes two ``actor_update`` steps (GRPO loss with KL, norm clipping or not, fused AdamW),
and syncs the actor into a full rollout replica (``sync_weights`` gathers sharded parameters); each is
compared with the same calls on an unparallelized copy. Under ``dp_shard``/``dp_replicate`` the groups are
placed across the ranks (3 groups on 2 ranks: uneven, a group split); loss and token counts still cover all
groups. Then the actor's weights and AdamW state are saved whole (``harness.rl.io``, as checkpoints and
traces do), restored into a fresh parallel actor, and one more update must match. The ``*-inf-one-rank``
case puts an inf in one TP rank's gradient shard only: every rank must raise NonFiniteError with gradients
and weights untouched (the guard's verdict is collective), and the next update must match one process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from support.torchrun_cases import launch_cases, max_rel, run_worker

BOUND = 1e-9
LAYOUTS = {"tp2": {"tp": 2}, "cp2": {"cp": 2}}
CASES = {
    f"{name}-{system}-{clip}": dict(dims=dims, system=system, clip=clip)
    for name, dims in LAYOUTS.items()
    for system in ("prefixflow", "baseline")
    for clip in ("clip", "noclip")
}
DP_LAYOUTS = {"dp_shard2": {"dp_shard": 2}, "dp_replicate2": {"dp_replicate": 2}}
CASES.update(
    {
        f"{name}-{system}-clip": dict(dims=dims, system=system, clip="clip")
        for name, dims in DP_LAYOUTS.items()
        for system in ("prefixflow", "baseline")
    }
)
CASES.update(  # 3 groups on 2 ranks: uneven; 1 group: split across the ranks (prefix K/V exchanged)
    {
        f"{name}-{n}groups-{system}-{clip}": dict(dims=DP_LAYOUTS[name], system=system, clip=clip, n_groups=n)
        for name, n, system, clip in (
            ("dp_shard2", 3, "prefixflow", "noclip"),
            ("dp_shard2", 3, "baseline", "clip"),
            ("dp_shard2", 1, "prefixflow", "clip"),
            ("dp_replicate2", 1, "prefixflow", "noclip"),
        )
    }
)
INF_CASES = {
    "tp2-inf-one-rank": dict(dims={"tp": 2}, system="prefixflow"),
    # a NaN loss on one rank: under DP and CP the ranks' losses differ; that rank must not raise alone
    "dp_shard2-nanloss-one-rank": dict(dims={"dp_shard": 2}, system="prefixflow", fault="loss"),
    "cp2-nanloss-one-rank": dict(dims={"cp": 2}, system="baseline", fault="loss"),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("rl_parallel") / "rl.json"
    return launch_cases(Path(__file__), 2, out)


@pytest.mark.parametrize("name", sorted(CASES))
def test_parallel_actor_matches_one_process(results, name):
    res = results[name]
    assert "error" not in res, res.get("error")
    assert res["logprob_rel"] < BOUND and not res.get("fsdp_residue"), res
    assert res["loss_rel"] < BOUND and res["grad_norm_rel"] < BOUND, res
    # all groups' tokens on every layout; a split group pads its parts separately (fewer padded slots)
    assert res["suffix_tokens"][0] == res["suffix_tokens"][1], res
    trunk = res["trunk_tokens"]
    assert trunk[1] == trunk[0] if res["n_groups"] > 1 else 0 < trunk[1] <= trunk[0], res
    assert res["weight_rel"] < BOUND, res
    sharded = name.startswith(("tp", "dp_shard"))
    assert res["synced_rel"] < BOUND and res["sharded_params"] == sharded, res
    # checkpoint and resume: weights and AdamW state gathered whole, then restored into a fresh parallel actor
    assert res["same_keys"] and res["saved_rel"] < BOUND, res
    assert res["resumed_rel"] < BOUND, res


def test_dp_actor_places_groups_across_ranks(results):
    """Under DP every response is trained once, on one rank, and every rank trains some (1 group: split)."""
    for name in (n for n in CASES if n.startswith("dp_")):
        res = results[name]
        assert "error" not in res, res.get("error")
        per_rank = res["responses_per_rank"]
        assert sum(per_rank) == res["n_responses"] and min(per_rank) > 0, (name, res)


@pytest.mark.parametrize("name", sorted(INF_CASES))
def test_inf_on_one_rank_raises_on_every_rank(results, name):
    res = results[name]
    assert "error" not in res, res.get("error")
    assert res["local_inf_ranks"] == 1, res  # the fault really is on one rank only
    assert res["raised_ranks"] == 2, res  # ... and every rank refused the step
    assert res["named_ranks"] == 1, res  # the rank that saw the non-finite value names it
    assert res["grads_kept"] and res["weights_kept_rel"] == 0.0, res
    assert res["after_loss_rel"] < BOUND and res["after_weight_rel"] < BOUND, res


# --- worker (runs on every rank) ----------------------------------------------------------------------------


MODEL = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=64)


def _build(seed: int, dims: dict | None = None):
    import torch

    import prefixflow as pf
    from prefixflow.parallel import parallelize

    model = pf.apply_prefixflow(
        pf.build_model("llama3:debugmodel", dtype=torch.float64, seed=seed, overrides=MODEL)
    )
    return model if dims is None else parallelize(model, dims)


def _groups(n: int) -> list:
    import torch

    import prefixflow as pf

    def group(seed: int, lens: list[int]) -> pf.RolloutGroup:
        g = pf.synthetic_group(64, 13, lens, seed=seed, with_logprobs=True)
        adv = torch.linspace(-1.0, 1.0, len(lens), dtype=torch.float64)
        return pf.RolloutGroup(g.prompt, g.responses, adv, g.old_logprobs, g.ref_logprobs)

    return [group(1, [5, 9, 3]), group(2, [4, 2, 7, 6]), group(3, [6, 2, 8])][:n]


def _whole(model) -> list:
    return [p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]


def _sum_over_ranks(value: float) -> list[float]:
    import torch
    import torch.distributed as dist

    out = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([float(value)], dtype=torch.float64))
    return [float(t) for t in out]


def _case(dims: dict, system: str, clip: str, n_groups: int = 2) -> dict:
    import contextlib

    import torch

    from prefixflow.hooks import ScheduleHooks, add_hooks
    from prefixflow.rl import actor_update, response_logprobs, sync_weights

    class CountResponses(ScheduleHooks):  # how many responses this rank trains (its Phase-B/full rows)
        n, now = 0, None

        @contextlib.contextmanager
        def phase(self, name):
            self.now = name
            yield

        def microbatch(self, mb):
            if self.now in ("B", "full"):  # a cached node's forward (A) and backward (C) train no response
                self.n += len(mb.responses)
            return super().microbatch(mb)

    single, actor, replica = _build(0), _build(0, dims), _build(1)
    counter = add_hooks(actor, CountResponses())
    groups = _groups(n_groups)
    got = response_logprobs(actor, groups[0].prompt, groups[0].responses)
    want = response_logprobs(single, groups[0].prompt, groups[0].responses)
    out = {"logprob_rel": max_rel(got, want)}
    if "dp_shard" in dims:  # evaluation leaves FSDP clean (units resharded) before the optimizer is built
        from prefixflow.parallel.fsdp import fsdp_residue

        out["fsdp_residue"] = fsdp_residue(actor)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (single, actor)]
    config = {"kl_coef": 0.05}
    loss_rel = norm_rel = 0.0
    for _ in range(2):
        stats = [
            actor_update(
                m, groups, o, system=system, loss_config=config, max_grad_norm=0.5 if clip == "clip" else None
            )
            for m, o in zip((single, actor), opts, strict=True)
        ]
        loss_rel = max(loss_rel, abs(stats[1].loss - stats[0].loss) / abs(stats[0].loss))
        norm_rel = max(norm_rel, abs(stats[1].grad_norm - stats[0].grad_norm) / stats[0].grad_norm)
    out.update(loss_rel=loss_rel, grad_norm_rel=norm_rel, n_groups=n_groups)
    out.update(
        suffix_tokens=[st.suffix_tokens for st in stats], trunk_tokens=[st.trunk_tokens for st in stats]
    )
    out["responses_per_rank"] = _sum_over_ranks(counter.n / 2)  # per update
    out["n_responses"] = sum(g.n for g in groups)
    out["weight_rel"] = max_rel(_whole(actor), _whole(single))
    out["sharded_params"] = any(hasattr(p, "full_tensor") for p in actor.parameters())
    sync_weights(actor, replica)
    out["synced_rel"] = max_rel(_whole(replica), _whole(single))
    from harness.rl.io import load_optimizer, load_weights, optimizer_tensors, state_tensors

    saved = {**state_tensors(actor, "w."), **optimizer_tensors(actor, opts[1])}
    want = {**state_tensors(single, "w."), **optimizer_tensors(single, opts[0])}
    out["same_keys"] = sorted(saved) == sorted(want) and not any(
        hasattr(t, "full_tensor") for t in saved.values()
    )
    out["saved_rel"] = max_rel([saved[k] for k in sorted(want)], [want[k] for k in sorted(want)])
    resumed = _build(2, dims)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2, fused=True)
    load_weights(resumed, saved, "saved", prefix="w.")
    load_optimizer(resumed, resumed_opt, saved, "saved")
    for m, o in ((single, opts[0]), (resumed, resumed_opt)):
        actor_update(m, groups, o, system=system, loss_config=config, max_grad_norm=0.5)
    out["resumed_rel"] = max_rel(_whole(resumed), _whole(single))
    return out


def _inf_case(dims: dict, system: str, fault: str = "grad") -> dict:
    """An inf in rank 0's shard of one TP-sharded gradient only (``fault="grad"``), or a NaN loss of one of
    rank 0's microbatches only (``"loss"``): every rank must refuse the step."""
    import torch
    import torch.distributed as dist

    import prefixflow as pf
    import prefixflow.schedule.stage as stage_module
    from prefixflow.rl import actor_update

    single, actor = _build(0), _build(0, dims)
    groups = _groups(2)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (single, actor)]
    kw = dict(system=system, loss_config={"kl_coef": 0.05}, max_grad_norm=0.5)
    for m, o in zip((single, actor), opts, strict=True):
        actor_update(m, groups, o, **kw)  # leaves gradients behind: they must survive the refused step
    name, param = next((n, p) for n, p in actor.named_parameters() if "attention.wq" in n)
    assert hasattr(param, "to_local") or fault == "loss", name  # a sharded parameter

    def spoil(p):
        if dist.get_rank() == 0 and fault == "grad":
            with torch.no_grad():
                p.grad.to_local().view(-1)[0] = float("inf")

    loss_of, spoiled = stage_module.microbatch_loss, []

    def nan_loss(*args, **kwargs):  # rank 0's first microbatch of the step
        value = loss_of(*args, **kwargs)
        if dist.get_rank() == 0 and fault == "loss" and not spoiled:
            spoiled.append(1)
            return value * float("nan")
        return value

    grads = [p.grad for p in actor.parameters()]
    grad_values = [(g.full_tensor() if hasattr(g, "full_tensor") else g).clone() for g in grads]
    weights = _whole(actor)
    weights = [w.clone() for w in weights]
    handle = param.register_post_accumulate_grad_hook(spoil)
    seen = []
    param.register_post_accumulate_grad_hook(
        lambda p: seen.append(not bool(torch.isfinite(getattr(p.grad, "_local_tensor", p.grad)).all()))
    )
    raised = named = 0
    stage_module.microbatch_loss = nan_loss
    try:
        actor_update(actor, groups, opts[1], **kw)
    except pf.NonFiniteError as e:
        raised = 1
        named = int("non-finite loss" in str(e) if fault == "loss" else f"gradient of {name}" in str(e))
    finally:
        stage_module.microbatch_loss = loss_of
    handle.remove()
    out = {
        "local_inf_ranks": sum(_sum_over_ranks(any(seen) if fault == "grad" else bool(spoiled))),
        "raised_ranks": sum(_sum_over_ranks(raised)),
        "named_ranks": sum(_sum_over_ranks(named)),
        "grads_kept": all(a is b for a, b in zip(grads, (p.grad for p in actor.parameters()), strict=True))
        and max_rel([g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads], grad_values) == 0.0,
        "weights_kept_rel": max_rel(_whole(actor), weights),
    }
    seen.clear()
    stats = [actor_update(m, groups, o, **kw) for m, o in zip((single, actor), opts, strict=True)]
    out["after_loss_rel"] = abs(stats[1].loss - stats[0].loss) / abs(stats[0].loss)
    out["after_weight_rel"] = max_rel(_whole(actor), _whole(single))
    return out


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    cases = {name: (lambda c=c: _case(**c)) for name, c in CASES.items()}
    cases.update({name: (lambda c=c: _inf_case(**c)) for name, c in INF_CASES.items()})
    run_worker(cases, sys.argv[1])
