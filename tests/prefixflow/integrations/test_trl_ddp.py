"""PrefixFlowGRPOTrainer on 2 CPU processes (accelerate's MULTI_CPU state: DDP over gloo), against TRL's own
GRPOTrainer under the same launch and seed: one SGD step, fp32. Started twice: with the project's loopback
launcher (``python -m harness.local_ranks``) and with torchrun (rendezvous on 127.0.0.1, gloo on ``lo``).

Each rank runs its own prompts' groups (or tree); the gradient of each micro-batch is averaged over the ranks
as DDP averages TRL's. TRL is deterministic here (two runs: identical weights). Cases: dapo; grpo with gradient
accumulation 2; multi-turn tool rollouts through a prefix tree; LoRA with sapo; ``verify_first_step`` with
gradient accumulation 2. The worker is
``tests/support/trl_ddp_worker.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")

from support.torchrun_cases import launch_cases, launch_torchrun  # noqa: E402

TESTS = Path(__file__).resolve().parents[2]
WORKER = TESTS / "support" / "trl_ddp_worker.py"


def _check(results: dict) -> None:
    assert set(results) == {"dapo", "grpo-ga2", "tools-tree", "lora-sapo", "verify-ga2"}
    for name, r in results.items():
        assert "error" not in r, (name, r.get("error"))
        assert r["world"] == 2, name
        assert r["trl_deterministic"] == 0.0, name
        assert r["ranks_agree"] == 0.0, name  # DDP: every rank holds the same weights after the step
        assert r["grad_size"] > 1e-3, name
        assert r["params"] <= 1e-5, (name, r)
        assert r["grads"] <= 1e-5, (name, r)  # the all-reduced gradients, per tensor
    assert results["tools-tree"]["trees"] == 1
    assert 0 < results["verify-ga2"]["verified"] <= 1e-5  # the first-step check compares this rank's own step


def test_ddp_two_processes_local_ranks(tmp_path):
    _check(launch_cases(WORKER, 2, tmp_path / "ddp.json"))


def test_ddp_two_processes_torchrun(tmp_path):
    _check(launch_torchrun(WORKER, 2, tmp_path / "ddp.json"))
