"""What Slurm says about a job's nodes: which nodes a job ran on, and which of them it holds lost.

A node is lost when Slurm has set it ``DOWN`` or ``FAIL`` (slurmctld does so when its slurmd stops answering
for ``SlurmdTimeout``, and then ends the node's jobs with ``NODE_FAIL``). ``NOT_RESPONDING`` alone is not
lost: Slurm has not decided yet, and the job may still finish.
"""

from __future__ import annotations

import re
import subprocess

__all__ = ["job_nodes", "lost_nodes", "slurmd_timeout_s"]

LOST_STATES = ("DOWN", "FAIL")
_FIELD = re.compile(r"(\w+)=(.*?)(?=\s+\w+=|$)")


def _scontrol(*args: str) -> str | None:
    try:
        out = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _fields(text: str | None) -> dict[str, str]:
    """``Key=Value`` pairs of one ``scontrol -o show`` line (values may hold spaces, as ``Reason`` does)."""
    return dict(_FIELD.findall((text or "").strip().splitlines()[0])) if (text or "").strip() else {}


def job_nodes(job_id: str) -> list[str]:
    """The names of the nodes ``job_id`` was given (empty while it waits, or once Slurm forgot it)."""
    nodelist = _fields(_scontrol("-o", "show", "job", job_id)).get("NodeList", "")
    if not nodelist or nodelist == "(null)":
        return []
    return (_scontrol("show", "hostnames", nodelist) or "").split()


def lost_nodes(nodes: list[str]) -> list[str]:
    """Each of ``nodes`` that Slurm holds lost, as ``node2 (DOWN+NOT_RESPONDING: Not responding)``."""
    lost = []
    for node in nodes:
        f = _fields(_scontrol("-o", "show", "node", node))
        state = f.get("State", "")
        if any(part in LOST_STATES for part in state.split("+")):
            reason = re.sub(r"\s*\[[^]]*\]$", "", f.get("Reason", "")).strip()
            lost.append(f"{node} ({state}{': ' + reason if reason and reason != '(null)' else ''})")
    return lost


def slurmd_timeout_s(default: float = 300.0) -> float:
    """The cluster's ``SlurmdTimeout``: how long a silent node may take to be set DOWN."""
    match = re.search(r"^SlurmdTimeout\s*=\s*(\d+)", _scontrol("show", "config") or "", re.M)
    return float(match.group(1)) if match else default
