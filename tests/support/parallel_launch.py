"""Shared by tests/test_parallel_*.py: run one suite of tests/support/parallel_worker.py on local ranks, once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.execute.local import run_local_ranks

TESTS = Path(__file__).resolve().parents[1]  # tests/: on the ranks' sys.path
TOL = 1e-9


def run_suite(suite: str, nproc: int, out_dir: Path, timeout_s: float = 1200) -> dict:
    out = out_dir / f"{suite}.json"
    proc = run_local_ranks(
        nproc, "support.parallel_worker", [suite, str(out)], timeout_s=timeout_s, extra_path=[TESTS]
    )
    if proc.returncode != 0 or not out.exists():
        pytest.fail(
            f"ranks of {suite} exited {proc.returncode}:\n{proc.stderr.decode(errors='replace')[-6000:]}"
        )
    return json.loads(out.read_text())


def check_exact(result: dict) -> None:
    assert "error" not in result, result["error"]
    assert not result["missing_params"]
    assert result["max_rel"] < TOL, result
    assert result["loss_rel"] < TOL, result
    assert not result.get("residue"), result["residue"]
