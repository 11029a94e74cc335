"""Layering, checked from the source: prefixflow/ never imports harness/, the core never imports
prefixflow/integrations/ (HF/TRL reach the core through prefixflow.adapters), and no import cycle runs at
import time. Imports inside functions are allowed to point back (they run after every module is loaded)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("prefixflow", "harness")


# --- harness layers (bottom first) ---
# Each entry is a module or package name prefix (the longest matching prefix places a module). A module may
# import only its own layer or lower ones (function-local and TYPE_CHECKING imports included) and must not
# form a cycle within its layer. The order reads as the pipeline: spec -> run -> execute -> sweep -> cli.
HARNESS_LAYERS = [
    ["harness", "harness.safe_fs", "harness.peers", "harness.costmodel", "harness.figures"],
    ["harness.records", "harness.contenders", "harness.simulate"],
    ["harness.spec"],
    ["harness.run"],
    ["harness.execute"],
    ["harness.sweep", "harness.rl", "harness.local_ranks"],
    ["harness.cli", "harness.rl_precision"],
]
# --- end harness layers ---


def _modules() -> dict[str, Path]:
    mods = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _import_nodes(tree: ast.AST):
    """(import statement, whether it sits inside a function); ``if TYPE_CHECKING:`` blocks are skipped."""
    todo: list[tuple[ast.AST, bool]] = [(tree, False)]
    while todo:
        node, in_function = todo.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, in_function
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            todo.append((child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))))


def _imports(mods: dict[str, Path]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module-level imports, all imports) per module, resolved to modules of this repository."""

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    top: dict[str, set[str]] = {}
    every: dict[str, set[str]] = {}
    for mod, path in mods.items():
        top[mod], every[mod] = set(), set()
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node, in_function in _import_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package[: len(package) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for target in filter(None, map(known, names)):
                if target != mod:
                    every[mod].add(target)
                    if not in_function:
                        top[mod].add(target)
    return top, every


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return found


def test_prefixflow_never_imports_harness_and_core_never_imports_integrations():
    _, every = _imports(_modules())
    to_harness = [
        (m, d) for m, ds in every.items() if m.startswith("prefixflow") for d in ds if d.startswith("harness")
    ]
    assert not to_harness, f"prefixflow/ imports harness/: {to_harness}"
    core = [m for m in every if m.startswith("prefixflow") and not m.startswith("prefixflow.integrations")]
    to_integrations = [(m, d) for m in core for d in every[m] if d.startswith("prefixflow.integrations")]
    assert not to_integrations, f"the core imports prefixflow/integrations/: {to_integrations}"


def test_no_import_cycle_at_import_time():
    top, _ = _imports(_modules())
    # A package's modules importing the package itself (re-exports in __init__) is how Python packages work.
    graph = {m: {d for d in ds if not m.startswith(d + ".")} for m, ds in top.items()}
    assert not _cycles(graph), f"module-level import cycles: {_cycles(graph)}"


def test_the_checks_see_a_planted_cycle_and_a_planted_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    top, every = _imports(_modules())
    assert "prefixflow.adapters" in every["prefixflow.integrations.hf"]
    assert "prefixflow.models" in top["prefixflow.adapters"]
