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

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")

from harness.execute.local import local_env, run_local_ranks  # noqa: E402

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


def _fail(proc):
    return f"ranks exited {proc.returncode}:\n{proc.stderr.decode(errors='replace')[-6000:]}"


def test_ddp_two_processes_local_ranks(tmp_path):
    out = tmp_path / "ddp.json"
    proc = run_local_ranks(
        2, str(WORKER), [str(out)], module=False, timeout_s=900, extra_path=[TESTS], cwd=TESTS.parent
    )
    assert proc.returncode == 0 and out.exists(), _fail(proc)
    _check(json.loads(out.read_text()))


def test_ddp_two_processes_torchrun(tmp_path):
    out = tmp_path / "ddp.json"
    with socket.socket() as s:  # a free loopback port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = local_env(threads=1)  # gloo pinned to lo, one thread per rank
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env["PYTHONPATH"]])
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--nnodes=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--local-addr=127.0.0.1",
        str(WORKER), str(out),
    ]  # fmt: skip
    proc = subprocess.run(argv, env=env, cwd=TESTS.parent, capture_output=True, timeout=900, check=False)
    assert proc.returncode == 0 and out.exists(), _fail(proc)
    _check(json.loads(out.read_text()))
