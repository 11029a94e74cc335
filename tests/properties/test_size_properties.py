"""``pf-bench frontier --budget``'s sizes (``harness.capacity.parse_size``): a number with a known unit is its
bytes, and any other text, however long or strange, is refused with a ValueError (the CLI's one line), never
another exception."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from support.properties import ci, fuzz
from typer.testing import CliRunner

from harness.capacity import parse_size
from harness.cli import app

UNITS = {"": 1, "B": 1, "K": 2**10, "KiB": 2**10, "KB": 10**3, "M": 2**20, "MiB": 2**20, "MB": 10**6,
         "G": 2**30, "GiB": 2**30, "GB": 10**9, "T": 2**40, "TiB": 2**40, "TB": 10**12}  # fmt: skip
CASE = st.sampled_from([str, str.lower, str.upper])
SPACE = st.sampled_from(["", " ", "  ", "\t"])


@st.composite
def sizes(draw):
    """A well-formed size: an integer or decimal count, a unit in any case, spaces around, and its bytes."""
    whole = draw(st.integers(0, 10**6))
    frac = draw(st.one_of(st.just(""), st.integers(0, 999).map(lambda f: f".{f:03d}")))
    unit = draw(st.sampled_from(sorted(UNITS)))
    text = f"{draw(SPACE)}{whole}{frac}{draw(SPACE)}{draw(CASE)(unit)}{draw(SPACE)}"
    return text, int(Fraction(f"{whole}{frac}") * UNITS[unit])


# Text near the grammar as well as anywhere in it: digits and unit letters in any order, signs, exponents,
# separators, non-ASCII digits, and counts long enough to overflow a float.
NEAR = st.text(alphabet="0123456789.eE+-_ ,kKmMgGtTiIbB٣\u00a0x", max_size=12)
HUGE = st.integers(300, 5000).map(lambda k: "9" * k) | st.integers(300, 400).map(
    lambda k: "1" + "0" * k + "G"
)
TEXT = st.one_of(NEAR, HUGE, st.text(max_size=20))


def _check_size(case):
    text, expected = case
    if expected < 1:
        with pytest.raises(ValueError, match="not a positive size"):
            parse_size(text)
    else:
        assert parse_size(text) == expected


def _check_text(text):
    try:
        size = parse_size(text)
    except ValueError as e:
        assert "\n" not in str(e) and repr(text)[:20] in str(e)  # one line naming what was given
    else:
        assert 1 <= size <= 2**62 and isinstance(size, int)


@ci(60)
@given(sizes())
@example((" 1.005 kb", 1005))  # 1.005 * 1000 is 1004.999... in floats
def test_a_number_with_a_known_unit_is_its_bytes(case):
    _check_size(case)


@ci(150)
@given(TEXT)
def test_any_other_text_is_a_size_or_a_one_line_value_error(text):
    _check_text(text)


@fuzz(5000)
@given(sizes())
def test_a_number_with_a_known_unit_is_its_bytes_fuzz(case):
    _check_size(case)


@fuzz(20000)
@given(TEXT)
def test_any_other_text_is_a_size_or_a_one_line_value_error_fuzz(text):
    _check_text(text)


def test_an_overflowing_budget_is_one_line_before_anything_runs(tmp_path):
    res = CliRunner().invoke(app, ["frontier", "--model", "llama3:debugmodel", "--budget", "9" * 400 + "G",
                                   "--out", str(tmp_path)])  # fmt: skip
    assert res.exit_code != 0 and isinstance(res.exception, SystemExit), (res.exception, res.output)
    assert "budget" in res.output and "Traceback" not in res.output
    assert not any(tmp_path.iterdir())
