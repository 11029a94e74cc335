"""Fixtures shared by the verl integration modules (they run in ``.venv-verl``; elsewhere they skip)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random-weight Qwen3 saved as verl's engines load one."""
    import verl_cpu as vc  # verl only exists in .venv-verl: the modules that use this skip before it runs

    path = tmp_path_factory.mktemp("qwen3-tiny")
    vc.save_tiny_model(path, "qwen3")
    return path
