"""``python tests/support/slurm_two_nodes.py REPO WORKDIR``, under ``support.slurm_cluster.UNSHARE`` only: a
DP2 cell through a two-node Slurm in network namespaces, printed as one ``REPORT {json}`` line.

1. The cluster comes up (support.slurm_cluster); each node's addresses, routes and daemon sockets are read.
2. ``one``: the DP2 cell with ``executor.nodes: 1`` (both ranks on one node), the reference record.
3. ``lost``: the same cell with ``executor.nodes: 2`` (one rank per node). Once node2's rank has connected
   to node1, node2 is lost (its slurmd and every process it runs, SIGKILL); the sweep must end.
4. ``resumed``: node2's slurmd restarts; ``--retry-failed`` reruns the cell on both nodes.
Every listening socket of every process is sampled while 2-4 run, with the namespace it lies in. All
``pf-bench`` commands run inside node1's namespaces, as from a login node; the sweeps' folders are shared.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support.slurm_cluster import NODES, Cluster, listeners, netns_id  # noqa: E402

SPEC = """name: dp2
systems: [baseline, prefixflow]
warmup: 1
repeats: {repeats}
axes:
  models: [{{name: 'llama3:debugmodel', overrides: {{dim: 32, n_layers: 2, n_heads: 2, vocab_size: 128}}}}]
  lengths: [{{prefix: 12, suffix: 4}}]
  n: [2]
  dtype: [fp64]
  parallel: [{{dp_replicate: 2}}]
executor: {{max_jobs: 1, timeout_min: 5, overcommit: true, mem_gb: 1, nodes: {nodes}}}
"""
REPEATS = 120  # several seconds of steps: losing a node lands mid-cell


class Sampler:
    """Every distinct listening socket seen while running, as (program, namespace, ip, port)."""

    def __init__(self, names: dict[str, str]) -> None:
        self.names, self.seen, self._stop = names, set(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for s in listeners():
                self.seen.add((s["program"], self.names.get(s["netns"], s["netns"]), s["ip"], s["port"]))
            time.sleep(0.2)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def rows(self) -> list[dict]:
        keys = ("program", "netns", "ip", "port")
        return [dict(zip(keys, row, strict=True)) for row in sorted(self.seen, key=str)]


def _records(folder: Path) -> list[dict]:
    import pandas as pd

    files = sorted(folder.glob("*.parquet"))
    if not files:
        return []
    df = pd.concat([pd.read_parquet(f) for f in files])
    rows = df.astype(object).where(df.notna(), None).to_dict("records")
    # Python's float repr round-trips: the report keeps every fp64 bit (pandas' to_json keeps 10 digits)
    return json.loads(json.dumps(rows, default=lambda v: v.item() if hasattr(v, "item") else str(v)))


def _rank_up(node: str, names: dict[str, str]) -> bool:
    """Whether a rank runs its collectives in ``node``: a python process listening there (gloo's pairs)."""
    return any(s["program"].startswith("python") and names.get(s["netns"]) == node for s in listeners())


def main(repo: Path, work: Path) -> dict:
    cluster = Cluster(work, repo)
    report: dict = {}
    try:
        started = time.monotonic()
        cluster.start()
        report["up_s"] = time.monotonic() - started
        names = {netns_id(cluster.holders[n].pid): n for n in NODES}
        names[netns_id("self")] = "outer"
        report["nodes"] = {
            n: {
                "addr": json.loads(cluster.on(n, "ip", "-j", "addr").stdout),
                "route": json.loads(cluster.on(n, "ip", "-j", "route").stdout),
                "hostname": cluster.on(n, "hostname").stdout.strip(),
            }
            for n in NODES
        }
        report["outer_addr"] = json.loads(
            subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True).stdout
        )
        report["daemons"] = [
            {**s, "netns": names.get(s["netns"], s["netns"])} for s in listeners() if s["program"] != "sleep"
        ]
        specs = {}
        for nodes in (1, 2):
            folder = work / "specs" / f"nodes{nodes}"
            folder.mkdir(parents=True)
            (folder / "dp2.yaml").write_text(SPEC.format(repeats=REPEATS, nodes=nodes))
            specs[nodes] = folder / "dp2.yaml"

        def sweep(nodes: int, out: str, *extra: str, background: bool = False):
            cmd = cluster.node_cmd(
                "node1", sys.executable, "-m", "harness.cli", "sweep", str(specs[nodes]), "--executor", "slurm",
                "--out", str(work / out), *extra,
            )  # fmt: skip
            if background:
                out = subprocess.PIPE
                return subprocess.Popen(
                    cmd, cwd=repo, env=cluster.env, stdout=out, stderr=subprocess.STDOUT, text=True
                )
            t = time.monotonic()
            res = subprocess.run(cmd, cwd=repo, env=cluster.env, capture_output=True, text=True, timeout=400)
            return {"rc": res.returncode, "out": (res.stdout + res.stderr)[-4000:], "s": time.monotonic() - t}

        with Sampler(names) as one_sockets:
            report["one"] = sweep(1, "one")
        report["one"]["sockets"] = one_sockets.rows()
        report["one"]["records"] = _records(work / "one" / "dp2")

        with Sampler(names) as lost_sockets:
            t = time.monotonic()
            proc = sweep(2, "two", background=True)
            deadline = time.monotonic() + 150
            while time.monotonic() < deadline and proc.poll() is None and not _rank_up("node2", names):
                time.sleep(0.2)
            report["lost_rank_up_s"] = time.monotonic() - t
            time.sleep(1.0)  # the ranks have met: the cell is under way
            report["killed"] = cluster.lose_node("node2")
            report["killed_at_s"] = time.monotonic() - t
            out, _ = proc.communicate(timeout=300)
            report["lost"] = {"rc": proc.returncode, "out": out[-4000:], "s": time.monotonic() - t}
        report["lost"]["sockets"] = lost_sockets.rows()
        report["lost"]["records"] = _records(work / "two" / "dp2")
        report["states_after_loss"] = cluster.node_states()

        cluster.start_slurmd("node2")
        cluster.wait_idle()
        with Sampler(names) as resumed_sockets:
            report["resumed"] = sweep(2, "two", "--retry-failed")
        report["resumed"]["sockets"] = resumed_sockets.rows()
        report["resumed"]["records"] = _records(work / "two" / "dp2")
        # the resumed job may still be tearing down when the sweep has its record; a requeued lost job would
        # run its whole cell again (tens of seconds): wait a few seconds for the queue to drain, not longer
        deadline = time.monotonic() + 8
        while (
            queue := cluster.on("node1", "squeue", "-h", check=False).stdout
        ).strip() and time.monotonic() < deadline:
            time.sleep(0.5)
        report["queue_after"] = queue
    finally:
        cluster.stop()
    return report


if __name__ == "__main__":
    out = json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2])))
    (Path(sys.argv[2]) / "report.json").write_text(out)
    print("REPORT " + out)
