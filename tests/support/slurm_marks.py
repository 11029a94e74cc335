"""The marks of a test module that submits jobs to the local Slurm: slow, and skipped without a client."""

from __future__ import annotations

import shutil

import pytest

SLURM_JOB_MARKS = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("sinfo") is None,
        reason="no Slurm client (sinfo) on PATH; start one with `bash scripts/slurm_up.sh`",
    ),
]
