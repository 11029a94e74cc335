"""A two-node Slurm inside network namespaces, for tests/harness/execute/test_slurm_two_nodes.py.

Run only under ``unshare -m -n -p -f -u --mount-proc --propagation private`` (see ``UNSHARE``): every
namespace, mount and process it makes lives inside those and ends with them, whatever happens.

- Two node namespaces (network + UTS), each held by a ``sleep`` process: ``node1`` (10.77.0.1) and
  ``node2`` (10.77.0.2), joined by one veth pair. Each holds only loopback and its own address (IPv6 off
  on the veth, no default route): nothing can leave them. Their hostnames resolve through a private
  /etc/hosts (bind-mounted), as a real cluster's do through its DNS.
- munged with a fresh key (tmpfs over the munge paths), slurmctld on node1, a slurmd per node, all on this
  cluster's own ports (``CTLD_PORT``/``SLURMD_PORT``) and a private slurm.conf (``SLURM_CONF``) whose
  ``CommunicationParameters=NoInAddrAny,NoCtldInAddrAny`` binds every daemon to its node's address.
- State, logs and the job-completion file under the given folder; a ``sacct`` shim reading that file
  (there is no accounting database), as scripts/slurm_up.sh installs for the single-node Slurm.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from support.slurm_ns import SLURM_PROGRAMS, _decode

UNSHARE = [
    "unshare",
    "-m",
    "-n",
    "-p",
    "-f",
    "-u",
    "--mount-proc",
    "--propagation",
    "private",
    "--kill-child",
]
NODES = {"node1": "10.77.0.1", "node2": "10.77.0.2"}
SUBNET = "10.77.0.0/24"
CTLD_PORT, SLURMD_PORT = 7817, 7818
SLURMD_TIMEOUT_S = 5  # a lost node is DOWN this long after its last answer (the site default is 300)
MUNGE_PATHS = ("/etc/munge", "/run", "/var/lib/munge", "/var/log/munge")


def run(*cmd: str, timeout: float = 60, check: bool = True, env=None) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and res.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} failed ({res.returncode}): {res.stdout[-2000:]} {res.stderr[-2000:]}"
        )
    return res


def netns_id(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def listeners() -> list[dict]:
    """Every TCP listening socket of every process, with the network namespace it lies in (each process's
    own /proc/PID/net), its program and pid."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            comm = (proc / "comm").read_text().strip()
            inodes = {}
            for name in ("tcp", "tcp6"):
                for line in (proc / "net" / name).read_text().splitlines()[1:]:
                    cols = line.split()
                    if len(cols) > 9 and cols[3] == "0A":  # TCP_LISTEN
                        inodes[int(cols[9])] = _decode(cols[1])
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and int(target[8:-1]) in inodes:
                    ip, port = inodes[int(target[8:-1])]
                    found.append(
                        {
                            "program": comm,
                            "pid": int(proc.name),
                            "netns": netns_id(proc.name),
                            "ip": ip,
                            "port": port,
                        }
                    )
        except (OSError, ValueError):  # the process ended while we looked
            continue
    return found


class Cluster:
    """The two nodes and their daemons; :meth:`stop` ends every process this class started."""

    def __init__(self, root: Path, repo: Path) -> None:
        self.root, self.repo = root, repo
        self.conf = root / "slurm.conf"
        self.bin = root / "bin"
        self.holders: dict[str, subprocess.Popen] = {}
        self.daemons: dict[str, subprocess.Popen | int] = {}
        self.env = {
            **os.environ,
            "SLURM_CONF": str(self.conf),
            "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH", "")) if p),
            "OMP_NUM_THREADS": "1",
        }

    # -- namespaces -----------------------------------------------------------------------------------
    def node_cmd(self, node: str, *cmd: str) -> list[str]:
        """``cmd`` run inside ``node``'s network and UTS namespaces."""
        return ["nsenter", "-t", str(self.holders[node].pid), "-n", "-u", "--", *cmd]

    def on(
        self, node: str, *cmd: str, timeout: float = 60, check: bool = True
    ) -> subprocess.CompletedProcess:
        return run(*self.node_cmd(node, *cmd), timeout=timeout, check=check, env=self.env)

    def _network(self) -> None:
        run("ip", "link", "set", "lo", "up")
        for node in NODES:
            self.holders[node] = subprocess.Popen(["unshare", "-n", "-u", "sleep", "infinity"])
        for node in NODES:  # wait until each holder is in its own namespace
            for _ in range(100):
                if netns_id(self.holders[node].pid) != netns_id("self"):
                    break
                time.sleep(0.02)
        run("ip", "link", "add", "pf-node1", "type", "veth", "peer", "name", "pf-node2")
        for node, addr in NODES.items():
            dev = f"pf-{node}"
            run("ip", "link", "set", dev, "netns", str(self.holders[node].pid))
            for cmd in (
                ("ip", "link", "set", "lo", "up"),
                ("ip", "link", "set", dev, "addrgenmode", "none"),  # no IPv6 link-local address
                ("ip", "addr", "add", f"{addr}/24", "dev", dev),
                ("ip", "link", "set", dev, "up"),
                ("hostname", node),
            ):
                self.on(node, *cmd)
        hosts = self.root / "hosts"
        hosts.write_text(
            "127.0.0.1 localhost\n::1 localhost\n" + "".join(f"{a} {n}\n" for n, a in NODES.items())
        )
        run("mount", "--bind", str(hosts), "/etc/hosts")

    # -- daemons --------------------------------------------------------------------------------------
    def _munge(self) -> None:
        for path in MUNGE_PATHS:
            run("mount", "-t", "tmpfs", "tmpfs", path)
        run("install", "-d", "-o", "munge", "-g", "munge", "-m", "0755", "/run/munge")
        for path in ("/etc/munge", "/var/lib/munge", "/var/log/munge"):
            run("chown", "munge:munge", path)
            os.chmod(path, 0o700)
        run("runuser", "-u", "munge", "--", "mungekey", "-c", "-k", "/etc/munge/munge.key")
        run("runuser", "-u", "munge", "--", "/usr/sbin/munged")
        for _ in range(50):
            if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError("munged did not answer")

    def write_conf(self) -> None:
        cpus = os.cpu_count() or 1
        state = self.root / "state"
        for sub in ("ctld", "spool", "log"):
            (state / sub).mkdir(parents=True, exist_ok=True)
        (state / "log" / "jobcomp.log").touch()
        nodes = ",".join(NODES)
        lines = [
            "ClusterName=pfns",
            f"SlurmctldHost=node1({NODES['node1']})",
            "SlurmUser=root",
            f"SlurmctldPort={CTLD_PORT}",
            f"SlurmdPort={SLURMD_PORT}",
            "CommunicationParameters=NoInAddrAny,NoCtldInAddrAny",
            "AuthType=auth/munge",
            f"StateSaveLocation={state}/ctld",
            f"SlurmdSpoolDir={state}/spool/%n",
            f"SlurmctldPidFile={state}/slurmctld.pid",
            f"SlurmdPidFile={state}/slurmd-%n.pid",
            f"SlurmctldLogFile={state}/log/slurmctld.log",
            f"SlurmdLogFile={state}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={state}/log/jobcomp.log",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "MpiDefault=none",
            f"SlurmdTimeout={SLURMD_TIMEOUT_S}",
            "KillWait=5",
            "MinJobAge=600",
            *(
                f"NodeName={n} NodeAddr={a} NodeHostname={n} CPUs={cpus} RealMemory=4000 State=UNKNOWN"
                for n, a in NODES.items()
            ),
            f"PartitionName=debug Nodes={nodes} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        self.bin.mkdir(exist_ok=True)
        shim = self.bin / "sacct"
        shim.write_text('#!/bin/sh\nexec /usr/bin/sacct --completion "$@"\n')
        shim.chmod(0o755)

    def start_slurmd(self, node: str) -> None:
        self.on(node, "/usr/sbin/slurmd", "-N", node)

    def start(self) -> None:
        self._network()
        self._munge()
        self.write_conf()
        self.on("node1", "/usr/sbin/slurmctld")
        for node in NODES:
            self.start_slurmd(node)
        self.wait_idle()

    def node_states(self) -> dict[str, str]:
        res = self.on("node1", "sinfo", "-h", "-N", "-o", "%N %t", check=False)
        return dict(line.split() for line in res.stdout.splitlines() if len(line.split()) == 2)

    def wait_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.node_states()
            if set(states) == set(NODES) and set(states.values()) == {"idle"}:
                return
            time.sleep(0.3)
        raise RuntimeError(f"nodes not idle after {timeout:.0f} s: {states}; logs in {self.root}/state/log")

    def processes(self, node: str) -> list[int]:
        """The pids of every process in ``node``'s network namespace but its holder."""
        ns, holder = netns_id(self.holders[node].pid), self.holders[node].pid
        return [
            int(p.name)
            for p in Path("/proc").iterdir()
            if p.name.isdigit() and int(p.name) != holder and netns_id(p.name) == ns
        ]

    def program_pids(self, node: str, program: str) -> list[int]:
        out = []
        for pid in self.processes(node):
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == program:
                    out.append(pid)
            except OSError:
                continue
        return out

    def lose_node(self, node: str) -> list[str]:
        """The node fails: SIGKILL its slurmd and all it runs (job steps, ranks). Returns what died."""
        killed = []
        for pid in self.processes(node):
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
                os.kill(pid, signal.SIGKILL)
                killed.append(comm)
            except (OSError, ProcessLookupError):
                continue
        return killed

    def stop(self) -> None:
        """Stop every daemon and holder (SIGTERM, then SIGKILL); the namespaces end with the holders."""
        pids = [
            pid
            for node in self.holders
            for program in SLURM_PROGRAMS
            for pid in self.program_pids(node, program)
        ]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
            time.sleep(0.1)
        for node in list(self.holders):
            for pid in self.processes(node):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.holders[node].kill()
            self.holders[node].wait()
        try:  # munged runs in the outer namespaces
            os.kill(int(Path("/run/munge/munged.pid").read_text().strip()), signal.SIGTERM)
        except (OSError, ValueError):
            pass
