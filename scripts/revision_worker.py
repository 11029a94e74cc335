"""Start this script's worker inside one source tree: that tree's ``prefixflow`` first on the path, one thread
(shared by scripts/exact_revisions.py and scripts/ab_revisions.py, which compare two revisions side by side)."""

from __future__ import annotations

import os
import subprocess
import sys


def start(root: str, script: str, *args: str, **popen) -> subprocess.Popen:
    """``python SCRIPT --worker ARGS...`` with cwd and PYTHONPATH at ``root``."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(root), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, os.path.abspath(script), "--worker", *args]
    return subprocess.Popen(argv, cwd=root, env=env, **popen)
