"""Shared fixtures: tiny TorchTitan shapes (dim 32-64, 2 layers) for fast exactness tests."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Tiny shapes with GQA (4 query heads over 2 KV heads).
TINY = {
    "llama3": (
        "llama3:debugmodel",
        {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 97},
    ),
    "qwen3": (
        "qwen3:debugmodel",
        {
            "dim": 64,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "head_dim": 16,
            "hidden_dim": 96,
            "vocab_size": 97,
        },
    ),
}


@pytest.fixture(params=sorted(TINY))
def family(request) -> str:
    return request.param


def tiny_model(family: str, dtype=torch.float64, ac: str = "none", seed: int = 0, **extra):
    import prefixflow as pf

    name, overrides = TINY[family]
    model = pf.build_model(name, dtype=dtype, seed=seed, overrides={**overrides, **extra})
    pf.apply_ac(model, ac)
    return pf.apply_prefixflow(model)


@pytest.fixture(autouse=True, scope="session")
def _private_jobs_dir():
    """Job files and submitit's pickles go to a private folder of this test session (0700, outside every
    test's results folder), not to ~/.cache."""
    previous = os.environ.get("PF_BENCH_JOBS_DIR")
    folder = tempfile.mkdtemp(prefix="pf-bench-jobs-")
    os.environ["PF_BENCH_JOBS_DIR"] = folder
    yield
    shutil.rmtree(folder, ignore_errors=True)
    if previous is None:
        os.environ.pop("PF_BENCH_JOBS_DIR", None)
    else:
        os.environ["PF_BENCH_JOBS_DIR"] = previous


def pytest_collection_modifyitems(config, items):
    """The ``fuzz`` tests (large hypothesis budgets, tests/properties) run only with ``PF_FUZZ=1``."""
    if os.environ.get("PF_FUZZ") == "1":
        return
    skip = pytest.mark.skip(reason="fuzz budget: run with PF_FUZZ=1 pytest -m fuzz tests/properties")
    for item in items:
        if "fuzz" in item.keywords:
            item.add_marker(skip)
