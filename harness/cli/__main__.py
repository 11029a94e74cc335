"""``python -m harness.cli``: the same command line as ``pf-bench``."""

from harness.cli import app

app()
