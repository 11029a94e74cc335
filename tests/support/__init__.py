"""What the tests share: reference implementations, tiny models and specs, multi-rank launchers and
workers, Slurm marks. ``tests/`` is on ``sys.path`` (its conftest), so tests import ``support.<module>``."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
