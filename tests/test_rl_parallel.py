"""The GRPO trainer pieces (``prefixflow.rl``) on a parallel actor: TP2 and CP2 against one process, fp64.

One launch of 2 local ranks. Per layout and system, every rank evaluates response log-probs with the
parallelized actor, takes two ``actor_update`` steps (2 groups each, GRPO loss with KL, norm clipping, fused
AdamW), and syncs the actor into a full rollout replica (``sync_weights`` gathers sharded parameters); each
is compared with the same calls on an unparallelized copy. Then the actor's weights and AdamW state are
saved whole (``harness.rl_io``, as checkpoints and traces do), restored into a fresh parallel actor, and one
more update must match. These are the pieces a multi-rank closed loop runs on every rank (README, "Not yet").
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _torchrun_cases import launch_cases, max_rel, run_worker

BOUND = 1e-9
LAYOUTS = {"tp2": {"tp": 2}, "cp2": {"cp": 2}}
CASES = {
    f"{name}-{system}-{clip}": dict(dims=dims, system=system, clip=clip)
    for name, dims in LAYOUTS.items()
    for system in ("prefixflow", "baseline")
    for clip in ("clip", "noclip")
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("rl_parallel") / "rl.json"
    return launch_cases(Path(__file__), 2, out)


@pytest.mark.parametrize("name", sorted(CASES))
def test_parallel_actor_matches_one_process(results, name):
    res = results[name]
    assert "error" not in res, res.get("error")
    assert res["logprob_rel"] < BOUND, res
    assert res["loss_rel"] < BOUND and res["grad_norm_rel"] < BOUND, res
    assert res["weight_rel"] < BOUND, res
    assert res["synced_rel"] < BOUND and res["sharded_params"] == (name.startswith("tp")), res
    # checkpoint and resume: weights and AdamW state gathered whole, then restored into a fresh parallel actor
    assert res["same_keys"] and res["saved_rel"] < BOUND, res
    assert res["resumed_rel"] < BOUND, res


# --- worker (runs on every rank) ----------------------------------------------------------------------------


def _case(dims: dict, system: str, clip: str) -> dict:
    import torch

    import prefixflow as pf
    from prefixflow.parallel import parallelize
    from prefixflow.rl import actor_update, response_logprobs, sync_weights

    kw = dict(
        dtype=torch.float64,
        seed=0,
        overrides={
            "dim": 32,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "vocab_size": 64,
            "max_seq_len": 64,
        },
    )
    single = pf.apply_prefixflow(pf.build_model("llama3:debugmodel", **kw))
    actor = parallelize(pf.apply_prefixflow(pf.build_model("llama3:debugmodel", **kw)), dims)
    replica = pf.apply_prefixflow(pf.build_model("llama3:debugmodel", **{**kw, "seed": 1}))

    def group(seed: int, lens: list[int]) -> pf.RolloutGroup:
        g = pf.synthetic_group(64, 13, lens, seed=seed, with_logprobs=True)
        adv = torch.linspace(-1.0, 1.0, len(lens), dtype=torch.float64)
        return pf.RolloutGroup(g.prompt, g.responses, adv, g.old_logprobs, g.ref_logprobs)

    groups = [group(1, [5, 9, 3]), group(2, [4, 2, 7, 6])]
    got = response_logprobs(actor, groups[0].prompt, groups[0].responses)
    want = response_logprobs(single, groups[0].prompt, groups[0].responses)
    out = {"logprob_rel": max_rel(got, want)}
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
    out.update(loss_rel=loss_rel, grad_norm_rel=norm_rel)
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in actor.parameters()]
    out["weight_rel"] = max_rel([w.detach() for w in whole], [p.detach() for p in single.parameters()])
    out["sharded_params"] = any(hasattr(p, "full_tensor") for p in actor.parameters())
    sync_weights(actor, replica)
    out["synced_rel"] = max_rel(
        [p.detach() for p in replica.parameters()], [p.detach() for p in single.parameters()]
    )
    from harness.rl_io import load_optimizer, load_weights, optimizer_tensors, state_tensors

    saved = {**state_tensors(actor, "w."), **optimizer_tensors(actor, opts[1])}
    want = {**state_tensors(single, "w."), **optimizer_tensors(single, opts[0])}
    out["same_keys"] = sorted(saved) == sorted(want) and not any(
        hasattr(t, "full_tensor") for t in saved.values()
    )
    out["saved_rel"] = max_rel([saved[k] for k in sorted(want)], [want[k] for k in sorted(want)])
    resumed = parallelize(pf.apply_prefixflow(pf.build_model("llama3:debugmodel", **{**kw, "seed": 2})), dims)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2, fused=True)
    load_weights(resumed, saved, "saved", prefix="w.")
    load_optimizer(resumed, resumed_opt, saved, "saved")
    for m, o in ((single, opts[0]), (resumed, resumed_opt)):
        actor_update(m, groups, o, system=system, loss_config=config, max_grad_norm=0.5)
    out["resumed_rel"] = max_rel(
        [p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach() for p in resumed.parameters()],
        [p.detach() for p in single.parameters()],
    )
    return out


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    run_worker({name: (lambda c=c: _case(**c)) for name, c in CASES.items()}, sys.argv[1])
