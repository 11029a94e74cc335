"""A DP2 cell on a two-node Slurm, simulated in network namespaces (tests/support/slurm_cluster.py).

One run of tests/support/slurm_two_nodes.py (about two minutes) feeds every test here:
- each node holds loopback and its own address only, with no route out; the daemons bind their node's
  address, and nothing of the cluster shows in this (the host's) namespace;
- the single-node DP2 cell keeps every rank socket on loopback;
- the two-node cell's store listens on node1's address only and each rank's sockets on its own node's;
- losing node2 mid-cell records ``error`` naming node2; after slurmd restarts, ``--retry-failed`` completes
  the cell, whose loss and gradients equal the single-node record's in fp64 and whose times are the max
  over the ranks of both nodes.
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support import REPO
from support.slurm_cluster import CTLD_PORT, NODES, SLURMD_PORT, SUBNET, UNSHARE, listeners, netns_id
from support.slurm_ns import SLURM_PROGRAMS, _decode

TOOLS = ("slurmctld", "slurmd", "sbatch", "unshare", "nsenter", "ip", "munged", "mungekey", "runuser")


def _namespaces_work() -> bool:
    try:
        return (
            subprocess.run(["unshare", "-n", "-m", "true"], capture_output=True, timeout=30).returncode == 0
        )
    except (OSError, subprocess.SubprocessError):
        return False


pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (creates network namespaces, starts daemons)"),
    pytest.mark.skipif(
        any(shutil.which(t) is None for t in TOOLS),
        reason=f"needs {', '.join(TOOLS)}: `bash scripts/slurm_up.sh --install-only`",
    ),
    pytest.mark.skipif(not _namespaces_work(), reason="`unshare -n -m` is refused here (no namespaces)"),
]
SUBNET_NET = ipaddress.ip_network(SUBNET)


def _die_with_pytest() -> None:
    """preexec_fn: SIGKILL ``unshare`` when pytest dies; its ``--kill-child`` then ends the namespaces."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _host_view() -> set[tuple[str, int]]:
    """Listening sockets in this (the host's) network namespace on the cluster's ports or addresses, and
    every listening socket of a cluster program held in this namespace."""
    found = set()
    for name in ("tcp", "tcp6"):
        for line in Path(f"/proc/self/net/{name}").read_text().splitlines()[1:]:
            cols = line.split()
            if len(cols) > 3 and cols[3] == "0A":
                ip, port = _decode(cols[1])
                addr = ipaddress.ip_address(ip)
                if port in (CTLD_PORT, SLURMD_PORT) or (addr.version == 4 and addr in SUBNET_NET):
                    found.add((ip, port))
    here = netns_id("self")
    cluster_programs = (*SLURM_PROGRAMS, "python", "python3")
    found |= {(s["ip"], s["port"]) for s in listeners() if s["netns"] == here and s["program"] in cluster_programs
              and s["port"] in (CTLD_PORT, SLURMD_PORT)}  # fmt: skip
    return found


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    work = tmp_path_factory.mktemp("two-nodes")
    seen: set[tuple[str, int]] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.update(_host_view())
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        res = subprocess.run(
            [
                *UNSHARE,
                sys.executable,
                str(REPO / "tests" / "support" / "slurm_two_nodes.py"),
                str(REPO),
                str(work),
            ],
            capture_output=True,
            text=True,
            timeout=600,
            preexec_fn=_die_with_pytest,
        )
    finally:
        done.set()
        watcher.join()
    lines = [line for line in res.stdout.splitlines() if line.startswith("REPORT ")]
    assert res.returncode == 0 and lines, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(lines[-1].removeprefix("REPORT "))
    r["host_sockets"] = sorted(seen)
    r["host_addrs"] = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    return r


def _by_system(records: list[dict]) -> dict[str, dict]:
    return {rec["system"]: rec for rec in records}


def _python(sockets: list[dict]) -> list[dict]:
    return [s for s in sockets if s["program"].startswith("python")]


def test_each_node_holds_only_its_address_and_no_route_out(report):
    for node, addr in NODES.items():
        info = report["nodes"][node]
        assert info["hostname"] == node
        addrs = {a["local"] for iface in info["addr"] for a in iface.get("addr_info", [])}
        assert addrs == {"127.0.0.1", "::1", addr}, addrs
        assert [r.get("dst") for r in info["route"]] == [SUBNET], info["route"]  # no default route
    outer = {a["local"] for iface in report["outer_addr"] for a in iface.get("addr_info", [])}
    assert outer <= {"127.0.0.1", "::1"}, outer


def test_daemons_bind_only_their_nodes_address(report):
    expected = {
        ("slurmctld", "node1", NODES["node1"], CTLD_PORT),
        ("slurmd", "node1", NODES["node1"], SLURMD_PORT),
        ("slurmd", "node2", NODES["node2"], SLURMD_PORT),
    }
    assert {(s["program"], s["netns"], s["ip"], s["port"]) for s in report["daemons"]} == expected
    for run in ("one", "lost", "resumed"):
        for s in report[run]["sockets"]:
            if not s["program"].startswith("python"):  # slurmctld, slurmd, srun, slurmstepd
                assert s["netns"] in NODES and s["ip"] == NODES[s["netns"]], (run, s)


def test_nothing_of_the_cluster_in_the_host_namespace(report):
    assert report["host_sockets"] == []
    assert "10.77." not in report["host_addrs"]


def test_single_node_cell_stays_on_loopback(report):
    one = report["one"]
    assert one["rc"] == 0, one["out"]
    assert {rec["status"] for rec in one["records"]} == {"ok"}
    ranks = _python(one["sockets"])
    assert ranks, one["sockets"]  # the sampler saw the job's store and gloo sockets
    assert {s["ip"] for s in ranks} == {"127.0.0.1"}, ranks


def test_two_node_cell_store_on_first_node_ranks_on_their_own(report):
    resumed = report["resumed"]
    assert resumed["rc"] == 0, resumed["out"]
    ranks = _python(resumed["sockets"])
    assert {s["netns"] for s in ranks} == set(NODES), ranks  # one rank per node
    for s in ranks:
        assert s["ip"] == NODES[s["netns"]], s  # never loopback, never a wildcard


def test_lost_node_is_named_and_resume_completes(report):
    assert {"slurmd", "python"} <= set(report["killed"]), report["killed"]
    lost = report["lost"]
    assert lost["rc"] == 1 and "1 of 1 cells failed {'error': 1}" in lost["out"], lost["out"]
    assert report["states_after_loss"]["node2"].startswith("down"), report["states_after_loss"]
    errors = {rec["error"] for rec in report["lost"]["records"]}
    assert len(errors) == 1 and errors.pop().startswith("node node2 (DOWN"), report["lost"]["records"]
    resumed = report["resumed"]
    assert resumed["rc"] == 0 and "statuses {'ok': 1}" in resumed["out"], resumed["out"]
    assert report["queue_after"].strip() == ""  # the lost job was cancelled, not requeued behind the sweep


def test_two_node_record_equals_single_node_in_fp64_and_holds_the_rank_max(report):
    one, two = _by_system(report["one"]["records"]), _by_system(report["resumed"]["records"])
    assert set(one) == set(two) == {"baseline", "prefixflow"}
    for system in one:
        a, b = one[system], two[system]
        assert b["status"] == "ok" and b["host"] == "node1"  # rank 0 on the job's first node
        for col in ("loss", "grad_norm", "grad_sha256"):
            assert a[col] is not None and a[col] == b[col], (system, col, a[col], b[col])
        per_rank = json.loads(b["step_time_s_per_rank"])
        assert len(per_rank) == 2 and all(t > 0 for t in per_rank)
        assert b["step_time_s"] >= max(per_rank)  # the median of the per-step maxima over both nodes
        assert len(json.loads(b["peak_mem_bytes_per_rank"])) == 2
