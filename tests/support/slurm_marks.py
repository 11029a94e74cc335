"""The marks of a test module that submits jobs to the local Slurm: slow, and skipped without a client.

With a client and no cluster they fail (``make test`` and CI start one), unless ``PF_SLURM_OPTIONAL=1`` says a
missing cluster is expected: ``make device-env-check`` sets it when no cluster answers, and they skip."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def _no_cluster_answers() -> bool:
    if os.environ.get("PF_SLURM_OPTIONAL") != "1" or shutil.which("sinfo") is None:
        return False
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=30).returncode != 0
    except (OSError, subprocess.SubprocessError):
        return True


SLURM_JOB_MARKS = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("sinfo") is None,
        reason="no Slurm client (sinfo) on PATH; start one with `bash scripts/slurm_up.sh`",
    ),
    pytest.mark.skipif(
        _no_cluster_answers(),
        reason="PF_SLURM_OPTIONAL=1 and no Slurm cluster answers; start one with `bash scripts/slurm_up.sh`",
    ),
]
