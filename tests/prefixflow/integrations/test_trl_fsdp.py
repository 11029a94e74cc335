"""PrefixFlowGRPOTrainer with the model sharded by PrefixFlow's FSDP2 on 2 CPU processes, against TRL's own
GRPOTrainer under DDP (accelerate's MULTI_CPU state ignores accelerate's FSDP plugin), same launch and seed: one
SGD step. Started twice: with the project's loopback launcher (``python -m harness.local_ranks``) and with
torchrun (rendezvous on 127.0.0.1, gloo on ``lo``).

Cases: dapo (also: TRL's rerun is bitwise equal, and ``save_model`` writes the full weights); multi-turn tool
rollouts through a prefix tree; a model the caller shards with ``parallelize`` before the trainer, with
gradient clipping active; dapo in fp64 (HF's norms and RoPE and TRL's LM head in fp64); TRL's bf16 with
``verify_first_step`` (its check in fp32); beta > 0 (TRL's reference model, unsharded); grpo with gradient
accumulation 2 (the ranks train different numbers of groups per micro-batch) and ``verify_first_step`` (TRL's
``compute_loss -> backward`` on the sharded model against PrefixFlow's, both reduce-scattered). A non-finite
loss on one rank: NonFiniteError on both, every gradient restored (the LM head's too, whose unit TRL's
forwards leave gathered). A model sharded with torch's own ``fully_shard`` is refused. Without the trainer,
``train_group`` on the sharded HF model (tied and untied, with HF's gradient checkpointing) against one process
(fp64). The worker is ``tests/support/trl_fsdp_worker.py``; the refusals that need no second process run here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("trl")

from support.torchrun_cases import launch_cases, launch_torchrun  # noqa: E402

TESTS = Path(__file__).resolve().parents[2]
WORKER = TESTS / "support" / "trl_fsdp_worker.py"


def _check(results: dict) -> None:
    units = {"units-untied-ac", "units-tied"}
    cases = {"dapo", "tools-tree", "presharded-clip", "dapo-fp64", "grpo-beta", "bf16-verify", "verify-ga2"}
    assert set(results) == {*cases, "nonfinite", "foreign", *units}
    foreign = results.pop("foreign")  # torch's own fully_shard, not PrefixFlow's units and hooks: refused
    assert "sharded with FSDP2 outside PrefixFlow" in foreign.get("message", ""), foreign
    r = results.pop("nonfinite")  # one rank's non-finite loss: both refuse, every gradient as before
    assert r == {"raised_everywhere": True, "grads_left": [], "residue": []}, r
    for name in units:  # train_group on the sharded HF model, no trainer, fp64
        r = results[name]
        assert "error" not in r, (name, r.get("error"))
        assert r["grads"] <= 1e-12, (name, r)
        assert r["residue"] == [], name
        assert r["reduce_scatters"] == {u: 2 for u in r["units"]}, name  # once per group
    assert results["units-untied-ac"]["units"] == [
        "model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm+lm_head"
    ]  # fmt: skip
    assert results["units-tied"]["units"] == [
        "model.layers.0",
        "model.layers.1",
        "model.embed_tokens+model.norm+lm_head",
    ]
    for name, r in results.items():
        if name in units:
            continue
        assert "error" not in r, (name, r.get("error"))
        assert r["world"] == 2, name
        wrappers = (r["trl_wrapper"], r["pf_wrapper"])  # accelerate wrapped TRL's model in DDP, not ours
        assert wrappers == ("DistributedDataParallel", "FSDPQwen3ForCausalLM"), name
        assert r["sharded"] == r["n_params"] > 0, name  # every parameter holds half of itself
        # one reduce-scatter per unit per micro-batch: the gradients are reduced once, never all-reduced again
        # (verify_first_step's check adds two to its first micro-batch: TRL's backward and PrefixFlow's)
        expected = r["micro_batches"] + (2 if "verify" in name else 0)
        assert r["reduce_scatters"] == {u: expected for u in r["reduce_scatters"]}, name
        assert len(r["reduce_scatters"]) == r["units"] == 4, name
        assert r["residue"] == [], name
        assert r["grad_size"] > 1e-3, name
        # bf16: autocast on both sides (one process, TRL vs PrefixFlowGRPOTrainer, differs by 1.6e-2 there too)
        tolerance = {"dapo-fp64": 1e-9, "bf16-verify": 5e-2}.get(name, 1e-5)
        assert r["params"] <= tolerance, (name, r)
        assert r["grads"] <= tolerance, (name, r)  # the full gradients the optimizer step applies, per tensor
        assert r["loss_diff"] <= 1e-6, (name, r)  # TRL's logging runs; the loss it logs is this rank's
        assert abs(r["grad_norm"] - r["trl_grad_norm"]) <= tolerance * r["trl_grad_norm"], (name, r)
        assert {"reward", "entropy", "completions/mean_length"} <= set(r["logged"]), name
    assert results["dapo"]["trl_deterministic"] == 0.0
    assert results["dapo"]["saved"] == 0.0  # save_model, reloaded with from_pretrained: the full weights
    assert results["tools-tree"]["trees"] == 1
    assert results["presharded-clip"]["grad_norm"] > 0.05  # max_grad_norm: the clip is active
    # verify_first_step: TRL's and PrefixFlow's reduce-scattered first-step gradients
    assert 0 < results["verify-ga2"]["verified"] <= 1e-5
    assert 0 < results["bf16-verify"]["verified"] <= 1e-5  # in fp32 under bf16 training


def test_fsdp_two_processes_local_ranks(tmp_path):
    _check(launch_cases(WORKER, 2, tmp_path / "fsdp.json"))


def test_fsdp_two_processes_torchrun(tmp_path):
    _check(launch_torchrun(WORKER, 2, tmp_path / "fsdp.json"))


def test_fsdp_refusals(tmp_path):
    """One line each, raised at construction, before anything is sharded."""
    import support.trl_fixtures as F

    with pytest.raises(ValueError, match=r"shards over every process, dp_shard=1 and nothing else"):
        F.trainer(tmp_path, prefixflow_parallel={"dp_shard": 2})
    with pytest.raises(ValueError, match="with FSDP2 does not support: checkpoints with optimizer state"):
        F.trainer(tmp_path, prefixflow_parallel={"dp_shard": 2}, save_strategy="steps", save_steps=1)
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    with pytest.raises(ValueError, match="with FSDP2 does not support: peft_config / a PEFT model"):
        F.trainer(tmp_path, prefixflow_parallel={"dp_shard": 2}, peft_config=lora)
    import prefixflow as pf
    from prefixflow.parallel import parallelize

    with pytest.raises(
        ValueError, match=r"^tp=2: parallelize applies TorchTitan's plans[^\n]*dp_shard \(FSDP2\)"
    ):
        parallelize(pf.apply_prefixflow(F.model()), {"tp": 2})  # before any process group or mesh is needed
