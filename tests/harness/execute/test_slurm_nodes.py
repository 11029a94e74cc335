"""Multi-node pieces that need no cluster: the rendezvous address, what Slurm's node states mean, the
``executor.nodes`` check. The two-node run itself is tests/harness/execute/test_slurm_two_nodes.py."""

from __future__ import annotations

import pytest

from harness.execute.slurm import LOOPBACK, rendezvous_address
from harness.execute.slurm_nodes import job_nodes, lost_nodes, slurmd_timeout_s
from harness.spec.load import SpecError, parse_spec

FAKE_SCONTROL = r"""#!/bin/sh
case "$*" in
  "-o show job 7_0") echo "JobId=7 ArrayJobId=7 ArrayTaskId=0 JobName=pf-x JobState=RUNNING Reason=None NodeList=node[1-2] BatchHost=node1" ;;
  "-o show job 8_0") echo "JobId=8 JobState=PENDING Reason=Resources NodeList=(null)" ;;
  "show hostnames node[1-2]") printf 'node1\nnode2\n' ;;
  "-o show node node1") echo "NodeName=node1 Arch=x86_64 State=IDLE+NOT_RESPONDING ThreadsPerCore=1 Reason=(null)" ;;
  "-o show node node2") echo "NodeName=node2 Arch=x86_64 State=DOWN+NOT_RESPONDING ThreadsPerCore=1 Reason=Not responding [slurm@2026-12-01T18:33:10]" ;;
  "-o show node node3") echo "NodeName=node3 State=MIXED+FAIL Reason=bad disk [root@2026-12-01T10:00:00] Comment=(null)" ;;
  "show config") printf 'SlurmctldTimeout        = 120 sec\nSlurmdTimeout           = 6 sec\n' ;;
  *) exit 1 ;;
esac
"""


@pytest.fixture
def fake_scontrol(tmp_path, monkeypatch):
    script = tmp_path / "scontrol"
    script.write_text(FAKE_SCONTROL)
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")


def test_one_node_rendezvous_is_loopback():
    assert rendezvous_address([]) == LOOPBACK
    assert rendezvous_address(["node7"]) == LOOPBACK  # not even resolved


def test_several_nodes_rendezvous_at_the_first_nodes_address():
    assert rendezvous_address(["192.0.2.7", "192.0.2.8"]) == "192.0.2.7"
    assert rendezvous_address(["fd00::7", "fd00::8"]) == "fd00::7"


def test_a_first_node_that_does_not_resolve_or_resolves_to_loopback_is_named():
    with pytest.raises(RuntimeError, match=r"first node 'no-such-node\.invalid' .* does not resolve"):
        rendezvous_address(["no-such-node.invalid", "node2"])
    with pytest.raises(RuntimeError, match=r"first node 'localhost' resolves to loopback only"):
        rendezvous_address(["localhost", "node2"])


def test_lost_nodes_are_down_or_failed_not_merely_silent(fake_scontrol):
    assert job_nodes("7_0") == ["node1", "node2"]
    assert job_nodes("8_0") == []  # still waiting: no nodes yet
    assert lost_nodes(["node1", "node2"]) == ["node2 (DOWN+NOT_RESPONDING: Not responding)"]
    assert lost_nodes(["node3"]) == ["node3 (MIXED+FAIL: bad disk)"]
    assert lost_nodes(["node1"]) == []  # not responding yet, not down: Slurm has not decided
    assert slurmd_timeout_s() == 6.0


def test_no_scontrol_means_no_lost_node(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert job_nodes("7_0") == [] and lost_nodes(["node2"]) == [] and slurmd_timeout_s() == 300.0


def _spec(parallel: dict, nodes: int) -> dict:
    return {
        "name": "nodes",
        "axes": {
            "models": [{"name": "llama3:debugmodel", "overrides": {"dim": 32, "n_layers": 2}}],
            "lengths": [{"prefix": 8, "suffix": 4}],
            "n": [2],
            "parallel": [{}, parallel],
        },
        "executor": {"nodes": nodes},
    }


def test_executor_nodes_must_divide_every_multi_rank_layout():
    assert parse_spec(_spec({"dp_replicate": 2}, 2)).executor.nodes == 2  # the single-rank cell is fine
    with pytest.raises(SpecError, match=r"executor.nodes=2 does not divide parallel layout tp3 \(3 ranks\)"):
        parse_spec(_spec({"tp": 3}, 2))
    with pytest.raises(SpecError, match=r"executor.nodes"):
        parse_spec(_spec({"dp_replicate": 2}, 0))
