"""The local test Slurm is reachable over loopback only, and its scripts touch only what they own.

- The LD_PRELOAD fence (scripts/slurm/loopback_bind.c) moves every bind to loopback (built here with gcc).
- The running cluster (CI starts it with scripts/slurm_up.sh): every daemon socket is a loopback socket.
- A whole up/job/down cycle in private namespaces, where the node also has a non-loopback address: the daemons
  and the job steps listen on loopback only and cannot be reached on that address; up refuses a foreign
  slurm.conf (and backs it up with --replace-conf); down refuses to signal a PID that is not its daemon,
  restores the backup and removes what up added.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO
from support.slurm_ns import FOREIGN_CONF, is_loopback, listening_sockets

SHIM_SOURCE = REPO / "scripts" / "slurm" / "loopback_bind.c"
BIND_PROBE = """
import json, socket
out = []
for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::"), (socket.AF_INET, None),
                     (socket.AF_INET6, None)):
    s = socket.socket(family)
    if host is not None:
        s.bind((host, 0))
    s.listen()  # an unbound socket listens on the wildcard address unless the fence binds it first
    out.append(s.getsockname()[0])
print(json.dumps(out))
"""
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (starts daemons in namespaces)")
needs_slurm_tools = pytest.mark.skipif(
    any(shutil.which(t) is None for t in ("slurmctld", "sbatch", "unshare", "gcc", "ss")),
    reason="needs Slurm, gcc, ss and unshare: `bash scripts/slurm_up.sh --install-only`",
)


def _probe_binds(tmp_path: Path, preload: Path | None) -> list[str]:
    env = dict(os.environ)
    if preload is not None:
        env["LD_PRELOAD"] = str(preload)
    res = subprocess.run(
        [sys.executable, "-c", BIND_PROBE], env=env, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build the fence")
def test_fence_moves_every_bind_to_loopback(tmp_path):
    shim = tmp_path / "libfence.so"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O2", "-Wall", "-o", str(shim), str(SHIM_SOURCE), "-ldl"], check=True
    )
    assert _probe_binds(tmp_path, None) == ["0.0.0.0", "::", "0.0.0.0", "::"]  # what Slurm does unfenced
    assert _probe_binds(tmp_path, shim) == ["127.0.0.1", "::1", "127.0.0.1", "::1"]


def _pid(path: str) -> int | None:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None


@pytest.mark.slurm
@pytest.mark.skipif(shutil.which("sinfo") is None, reason="no Slurm client; `bash scripts/slurm_up.sh`")
def test_running_slurm_listens_on_loopback_only():
    ctld, slurmd = _pid("/run/slurmctld.pid"), _pid("/run/slurmd.pid")
    if ctld is None or slurmd is None:
        pytest.skip("the local Slurm is not running; start it with `bash scripts/slurm_up.sh`")
    sockets = listening_sockets()
    ports = {(s["program"], s["port"]) for s in sockets}
    assert {("slurmctld", 6817), ("slurmd", 6818)} <= ports, sockets  # found the daemons' sockets
    assert [s for s in sockets if not is_loopback(s["ip"])] == [], "Slurm listens beyond loopback"


@pytest.mark.slurm
@pytest.mark.slow
@needs_root
@needs_slurm_tools
def test_slurm_lifecycle_in_namespaces():
    cmd = ["unshare", "-m", "-n", "-p", "-f", "--mount-proc", "--propagation", "private"]
    res = subprocess.run(
        [*cmd, sys.executable, str(REPO / "tests" / "support" / "slurm_ns.py"), str(REPO)],
        capture_output=True,
        text=True,
        timeout=400,
    )
    lines = [line for line in res.stdout.splitlines() if line.startswith("REPORT ")]
    assert res.returncode == 0 and lines, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(lines[-1].removeprefix("REPORT "))

    refused = r["foreign_conf"]
    assert refused["rc"] == 1 and "refusing to overwrite" in refused["err"], refused
    assert refused["conf_kept"] and not refused["added_anything"]

    assert r["up"]["rc"] == 0 and "backed up" in r["up"]["out"], r["up"]
    daemons = {(s["program"], s["port"]) for s in r["daemons"]}
    assert {("slurmctld", 6817), ("slurmd", 6818)} <= daemons, r["daemons"]
    assert [s for s in r["daemons"] if not is_loopback(s["ip"])] == []
    assert r["loopback_connects"] == {"6817": True, "6818": True}
    assert r["outer_connects"] == {"6817": False, "6818": False}  # the node's other address: closed

    job = r["job"]
    assert job["rc"] == 0 and any(s["program"] == "srun" for s in job["sockets"]), job
    assert [s for s in job["sockets"] if not is_loopback(s["ip"])] == [], job["sockets"]

    foreign = r["foreign_pid"]
    assert foreign["rc"] == 1 and "not signalling it" in foreign["err"], foreign
    assert foreign["decoy_alive"] and foreign["conf_kept"] and foreign["own_dir_kept"]

    assert r["down"]["rc"] == 0, r["down"]
    after = r["after_down"]
    assert after["conf"] == FOREIGN_CONF and not after["backup_left"]  # the site's file is back
    assert not after["own_dir_left"] and after["sockets"] == []
