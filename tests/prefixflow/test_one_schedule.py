"""One set of phases, checked from the source: the phase functions never tell a flat group from a tree, and one
call site drives every cached node's delayed backward."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "prefixflow"
PHASES = ROOT / "schedule" / "phases.py"
SHAPE_NAMES = {"tree_plan", "TreePlan", "RolloutTree", "RolloutGroup", "group_tree", "prompt_len"}


def _functions(path: Path) -> list[ast.FunctionDef]:
    tree = ast.parse(path.read_text())
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]


def shape_references(source: str) -> list[str]:
    """Every place a function of ``source`` names a group's shape or branches on a group's type."""
    found = []
    for fn in (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)):
        for node in ast.walk(fn):
            name = (
                node.id
                if isinstance(node, ast.Name)
                else node.attr
                if isinstance(node, ast.Attribute)
                else None
            )
            if name in SHAPE_NAMES:
                found.append(f"{fn.name}:{node.lineno} names {name}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "type"):
                found.append(f"{fn.name}:{node.lineno} tests a type")
    return found


def test_the_phase_functions_never_name_a_shape():
    assert {f.name for f in _functions(PHASES)} >= {
        "node_forwards",
        "leaf_microbatches",
        "node_backwards",
        "path_microbatches",
        "waves",
    }
    assert shape_references(PHASES.read_text()) == []


@pytest.mark.parametrize(
    "injected",
    [
        "def node_forwards(run, caches, wave):\n    if run.tree_plan is not None:\n        return 0\n",
        "def leaf_microbatches(run, caches, wave):\n    if isinstance(run.group, RolloutGroup):\n        pass\n",
        "def node_backwards(run, caches, wave):\n    return run.group.prompt_len\n",
    ],
)
def test_the_check_fails_on_an_injected_branch(injected):
    assert shape_references(PHASES.read_text() + "\n\n" + injected)


def _backward_prefix_calls() -> list[str]:
    calls = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "backward_prefix":
                calls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return calls


def test_one_call_site_drives_the_prefix_backward():
    calls = _backward_prefix_calls()
    assert len(calls) == 1 and calls[0].startswith("schedule/phases.py"), calls
