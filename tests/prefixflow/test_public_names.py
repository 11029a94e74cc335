"""Every name docs/library.md documents imports from where it says: ``pf.X`` (the package), the calls listed
in bold (``prefixflow.X``), and dotted module paths (``prefixflow.alignment.run_alignment``: modules that moved
into packages still import under their documented path)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

LIBRARY = Path(__file__).resolve().parents[2] / "docs" / "library.md"


def documented_names(text: str) -> list[tuple[str, str]]:
    """``(module, name)`` for each name the page documents."""
    names = {("prefixflow", n) for n in re.findall(r"\bpf\.([A-Za-z_]\w*)", text)}
    names |= {("prefixflow", n) for n in re.findall(r"\*\*`([A-Za-z_]\w*)\(", text)}
    for path in re.findall(r"`(prefixflow(?:\.[a-z_]\w*)+)", text):
        module, _, name = path.rpartition(".")
        names.add((module, name))
    return sorted(names)


NAMES = documented_names(LIBRARY.read_text())


def test_the_page_documents_the_public_calls():
    found = {name for _, name in NAMES}
    assert {
        "build_model",
        "RolloutGroup",
        "build_tree",
        "train_group",
        "score_group",
        "run_alignment",
    } <= found


@pytest.mark.parametrize("module,name", NAMES)
def test_each_documented_name_imports(module, name):
    assert getattr(importlib.import_module(module), name) is not None


def test_the_check_fails_on_a_name_that_does_not_import():
    ((module, name),) = documented_names("see `prefixflow.alignment.no_such_call`")
    with pytest.raises(AttributeError):
        getattr(importlib.import_module(module), name)
