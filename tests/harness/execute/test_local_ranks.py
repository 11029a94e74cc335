"""Local multi-rank launches listen on loopback only, and fail as one job (``harness.execute.local_ranks``).

While two real gloo ranks hold their process group open, every listening TCP socket of the launch's process
tree (the launcher's store, each rank's gloo pairs) is read from ``/proc/net/tcp{,6}``: each must be bound to
a loopback address. ``torchrun --standalone`` fails this test (its agent's stores listen on ``*:port``).
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.execute.local import local_env, local_ranks_argv, run_local_ranks

REPO = Path(__file__).resolve().parents[3]  # this file is also the ranks' script: no test imports
LISTEN = "0A"


def _tree(root: int) -> set[int]:
    """``root`` and its descendants."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            parents[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, grew = {root}, True
    while grew:
        new = {pid for pid, ppid in parents.items() if ppid in tree} - tree
        tree |= new
        grew = bool(new)
    return tree


def _socket_inodes(pids: set[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return inodes


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))  # /proc prints host-order 32-bit words
    addr = ipaddress.IPv6Address(words)
    return addr.ipv4_mapped or addr


def listening(pids: set[int]) -> list[tuple[str, int]]:
    """``(address, port)`` of every listening TCP socket held by ``pids``."""
    inodes, found = _socket_inodes(pids), []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN and fields[9] in inodes:
                host, port = fields[1].split(":")
                found.append((str(_address(host)), int(port, 16)))
    return found


def test_address_decoding():
    assert _address("0100007F") == ipaddress.IPv4Address("127.0.0.1")
    assert _address("00000000000000000000000000000000") == ipaddress.IPv6Address("::")
    assert _address("00000000000000000000000001000000") == ipaddress.IPv6Address("::1")
    assert _address("0000000000000000FFFF00000100007F") == ipaddress.IPv4Address("127.0.0.1")


def test_a_two_rank_launch_listens_on_loopback_only(tmp_path):
    ready, release = tmp_path / "ready", tmp_path / "release"
    argv = local_ranks_argv(2, __file__, ["hold", str(ready), str(release)], module=False)
    proc = subprocess.Popen(
        argv,
        env=local_env(1),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[1].decode(errors="replace")[-4000:]
            assert time.monotonic() < deadline, "the ranks never joined their process group"
            time.sleep(0.2)
        pids = _tree(proc.pid)
        sockets = listening(pids)
        assert len(pids) == 3  # the launcher and two ranks
        assert len(sockets) >= 3, (
            sockets
        )  # the store and each rank's gloo listener, so the check is not vacuous
        outside = [(a, p) for a, p in sockets if not ipaddress.ip_address(a).is_loopback]
        assert not outside, f"listening beyond loopback: {outside}"
        release.touch()
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode(errors="replace")[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the launch's own group: no rank left behind
            proc.wait()


def test_a_failing_rank_stops_the_others_and_its_status_is_the_launchs(tmp_path):
    pid_file = tmp_path / "pid"
    argv = local_ranks_argv(2, __file__, ["fail", str(pid_file)], module=False)
    started = time.monotonic()
    proc = subprocess.run(argv, env=local_env(1), cwd=REPO, capture_output=True, timeout=300)
    assert proc.returncode == 3, proc.stderr.decode(errors="replace")[-4000:]
    assert "rank 1 exited with 3" in proc.stderr.decode()
    assert time.monotonic() - started < 120  # not the surviving rank's 600 s sleep
    survivor = int(pid_file.read_text())
    assert not Path(f"/proc/{survivor}").exists()  # stopped and reaped: no rank left behind


def _dead(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_ranks_die_with_a_killed_launcher(tmp_path):
    """``run_local_ranks``' timeout SIGKILLs the launcher: no rank may outlive it (``PR_SET_PDEATHSIG``)."""
    with pytest.raises(subprocess.TimeoutExpired):
        run_local_ranks(2, __file__, ["sleep", str(tmp_path)], timeout_s=30, module=False, cwd=REPO)
    pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    assert len(pids) == 2, "the ranks did not start within the timeout"
    deadline = time.monotonic() + 10
    while not all(_dead(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [pid for pid in pids if not _dead(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, "ranks outlived their launcher"


def _hold(ready: str, release: str) -> None:
    """Join a gloo group, all-reduce, and keep it open until the test has read the sockets."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
    dist.barrier()
    if dist.get_rank() == 0:
        Path(ready).touch()
    deadline = time.monotonic() + 300
    while not Path(release).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    dist.barrier()
    dist.destroy_process_group()


def _fail(pid_file: str) -> None:
    """Rank 1 fails at once; rank 0 would sleep for 10 minutes."""
    if os.environ["RANK"] == "1":
        deadline = time.monotonic() + 60
        while not Path(pid_file).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        raise SystemExit(3)
    Path(pid_file).write_text(str(os.getpid()))
    time.sleep(600)


def _sleep(folder: str) -> None:
    Path(folder, f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    time.sleep(600)


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "hold":
        _hold(*rest)
    elif mode == "sleep":
        _sleep(*rest)
    elif mode == "fail":
        _fail(*rest)
    else:
        pytest.fail(f"unknown mode {mode}")
