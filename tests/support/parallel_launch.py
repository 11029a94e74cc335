"""Shared by tests/test_parallel_*.py: run one suite of tests/support/parallel_worker.py on local ranks, once."""

from __future__ import annotations

from pathlib import Path

from support.torchrun_cases import launch_worker

TOL = 1e-9


def run_suite(suite: str, nproc: int, out_dir: Path, timeout_s: float = 1200) -> dict:
    out = out_dir / f"{suite}.json"
    return launch_worker("support.parallel_worker", nproc, [suite, str(out)], out, timeout=timeout_s)


def check_exact(result: dict) -> None:
    assert "error" not in result, result["error"]
    assert not result["missing_params"]
    assert result["max_rel"] < TOL, result
    assert result["loss_rel"] < TOL, result
    assert not result.get("residue"), result["residue"]
