"""Hypothesis budgets for the property-based suites (``tests/properties``).

CI: ``derandomize=True`` (the same examples every run), no deadline, no example database, a few dozen
examples per property (the suites take under 3 minutes together on 2 cores). ``fuzz``: the same properties at
a larger budget with fresh examples, as separate tests marked ``fuzz``; they run only with ``PF_FUZZ=1``
(``PF_FUZZ=1 pytest -m fuzz tests/properties``), and ``PF_FUZZ_EXAMPLES`` scales them.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def ci(examples: int):
    """A property's CI budget: ``examples`` derandomized examples."""
    return settings(max_examples=examples, derandomize=True, **_COMMON)


def fuzz(examples: int):
    """A property's ``fuzz`` budget: marked ``fuzz``, random examples, ``PF_FUZZ_EXAMPLES`` overrides."""
    examples = int(os.environ.get("PF_FUZZ_EXAMPLES", examples))

    def wrap(test):
        return pytest.mark.fuzz(settings(max_examples=examples, derandomize=False, **_COMMON)(test))

    return wrap
