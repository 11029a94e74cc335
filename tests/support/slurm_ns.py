"""Listening-socket inspection, and a Slurm lifecycle run inside private namespaces (for test_slurm_fence).

``listening_sockets()`` reads /proc/net/tcp{,6} and each process's socket fds: which process listens where.

``python tests/support/slurm_ns.py REPO`` must run under ``unshare -m -n -p -f --mount-proc``: it gives the new
network namespace loopback plus one more address (10.254.0.1 on lo, so that a wildcard bind would be
reachable on something other than 127.0.0.1), hides every path scripts/slurm_up.sh and slurm_down.sh
touch behind tmpfs mounts, then runs the scripts against hostile situations and prints a JSON report.
Nothing it does is visible outside the namespaces; its only traffic goes to addresses of its own namespace.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

SLURM_PROGRAMS = ("slurmctld", "slurmd", "slurmstepd", "srun", "munged", "sbatch", "salloc")
OUTER_ADDRESS = "10.254.0.1"  # only ever configured inside the test's own network namespace


def _decode(hex_addr: str) -> tuple[str, int]:
    addr, port = hex_addr.split(":")
    raw = bytes.fromhex(addr)
    if len(raw) == 4:
        ip = str(ipaddress.IPv4Address(raw[::-1]))
    else:  # four little-endian 32-bit words
        ip = str(ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))))
    return ip, int(port, 16)


def _listening_inodes(proc: Path) -> dict[int, tuple[str, int]]:
    out = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A":  # TCP_LISTEN
                out[int(cols[9])] = _decode(cols[1])
    return out


def listening_sockets(programs: tuple[str, ...] = SLURM_PROGRAMS) -> list[dict]:
    """Every TCP listening socket held by a process whose name is in ``programs`` (this namespace)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            comm = (proc / "comm").read_text().strip()
            if comm not in programs:
                continue
            inodes = _listening_inodes(proc)
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inode = int(target[8:-1])
                    if inode in inodes:
                        ip, port = inodes[inode]
                        found.append({"program": comm, "pid": int(proc.name), "ip": ip, "port": port})
        except OSError:  # the process ended while we looked
            continue
    return found


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


# ---- inside the namespaces -------------------------------------------------------------------------------

HIDDEN = (
    "/run",
    "/etc/slurm",
    "/var/lib/slurm",
    "/var/log/slurm",
    "/var/lib/munge",
    "/var/log/munge",
)
FOREIGN_CONF = "# a site's own slurm.conf\nClusterName=theirs\n"


def _sh(*cmd: str, timeout: float = 120) -> dict:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return {"rc": res.returncode, "out": res.stdout[-3000:], "err": res.stderr[-3000:]}


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def _setup() -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(["ip", "addr", "add", f"{OUTER_ADDRESS}/32", "dev", "lo"], check=True)
    for path in HIDDEN:
        _mount("-t", "tmpfs", "tmpfs", path)
    # /usr/local/lib may hold Python itself: hide only pf-slurm, bind everything else back
    keep = Path("/run/usr-local-lib")
    keep.mkdir()
    _mount("--bind", "/usr/local/lib", str(keep))
    _mount("-t", "tmpfs", "tmpfs", "/usr/local/lib")
    for entry in keep.iterdir():
        if entry.name == "pf-slurm":
            continue
        target = Path("/usr/local/lib") / entry.name
        if entry.is_dir() and not entry.is_symlink():
            target.mkdir()
        elif entry.is_symlink():
            target.symlink_to(os.readlink(entry))
            continue
        else:
            target.touch()
        _mount("--bind", str(entry), str(target))
    for path, owner in (
        ("/var/lib/slurm", "slurm"),
        ("/var/log/slurm", "slurm"),
        ("/var/lib/munge", "munge"),
        ("/var/log/munge", "munge"),
    ):
        subprocess.run(["chown", f"{owner}:{owner}", path], check=True)
    os.chmod("/var/lib/munge", 0o700)


def _connects(ip: str, port: int) -> bool:
    with socket.socket(socket.AF_INET) as s:
        s.settimeout(2)
        return s.connect_ex((ip, port)) == 0


def main(repo: str) -> dict:
    up, down = f"{repo}/scripts/slurm_up.sh", f"{repo}/scripts/slurm_down.sh"
    conf = Path("/etc/slurm/slurm.conf")
    _setup()
    report: dict = {}
    conf.write_text(FOREIGN_CONF)
    report["foreign_conf"] = {
        **_sh("bash", up),
        "conf_kept": conf.read_text() == FOREIGN_CONF,
        "added_anything": Path("/usr/local/lib/pf-slurm").exists(),
    }
    report["up"] = _sh("bash", up, "--replace-conf")
    report["daemons"] = listening_sockets()
    report["outer_connects"] = {p: _connects(OUTER_ADDRESS, p) for p in (6817, 6818)}
    report["loopback_connects"] = {p: _connects("127.0.0.1", p) for p in (6817, 6818)}
    job = _sh("sbatch", "--parsable", "-o", "/dev/null", "--wrap", "srun sleep 30")
    steps: list[dict] = []
    for _ in range(100):  # until srun listens (its I/O sockets)
        steps = listening_sockets()
        if any(s["program"] == "srun" for s in steps):
            break
        time.sleep(0.2)
    report["job"] = {**job, "sockets": steps}
    _sh("scancel", job["out"].strip())
    # down must not signal a process that is not its daemon, whatever the pid file says
    decoy = subprocess.Popen(["sleep", "300"])
    real = Path("/run/slurmd.pid").read_text()
    Path("/run/slurmd.pid").write_text(f"{decoy.pid}\n")
    foreign_pid = _sh("bash", down)
    report["foreign_pid"] = {
        **foreign_pid,
        "decoy_alive": decoy.poll() is None,
        "conf_kept": conf.exists(),
        "own_dir_kept": Path("/usr/local/lib/pf-slurm").exists(),
    }
    decoy.kill()
    Path("/run/slurmd.pid").write_text(real)
    report["down"] = _sh("bash", down)
    report["after_down"] = {
        "conf": conf.read_text() if conf.exists() else None,
        "backup_left": Path("/etc/slurm/slurm.conf.pf-bench-backup").exists(),
        "own_dir_left": Path("/usr/local/lib/pf-slurm").exists(),
        "sockets": listening_sockets(),
    }
    return report


if __name__ == "__main__":
    print("REPORT " + json.dumps(main(sys.argv[1])))
