"""Layering, checked from the source.

Every module of prefixflow/ and harness/ has a layer (the tables below, bottom layer first). An import may
point to the importer's own layer or a lower one, never a higher one, and no modules import each other in a
circle. Every import counts: module-level ones, those inside functions and those under ``if TYPE_CHECKING:``.
Importing ``a.b.c`` counts as importing the packages ``a.b`` and ``a`` too (Python runs their ``__init__``
first), except the importer's own packages; a name taken from a package counts as an import of the module
that defines it, so a re-export (``from .x import y`` in an ``__init__``) hides no upward import.

Also: prefixflow/ never imports harness/, and the core never imports prefixflow/integrations/ (HF and TRL
reach the core through prefixflow.model.adapters).

A table entry is a module name and covers that module and every module under it; the longest entry that
covers a module gives its layer. A top-level package's entry (``prefixflow``, ``harness``) covers only its
``__init__``, so a new module has no layer until it is placed.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("prefixflow", "harness")

PREFIXFLOW_LAYERS = [
    # what a model's PrefixFlow state is, what a group and a tree are, the loss, what a layer caches, memory
    [
        "prefixflow.runtime",
        "prefixflow.group",
        "prefixflow.loss",
        "prefixflow.tree",
        "prefixflow.attention",
        "prefixflow.state",
        "prefixflow.model",
        "prefixflow.memory",
        "prefixflow.checks",
        "prefixflow.schedule",
    ],
    # how the schedule reaches a model: the registry, adapters, the transforms, hooks, offload, the guard
    [
        "prefixflow.model.adapters",
        "prefixflow.model.apply",
        "prefixflow.model.compile",
        "prefixflow.hooks",
        "prefixflow.memory.offload",
        "prefixflow.memory.storage",
        "prefixflow.memory.fake_tier",
        "prefixflow.schedule.grad_guard",
    ],
    # the schedule: GroupRun, the stage, the caches, the phase functions, validation, stats, the driver
    [
        "prefixflow.schedule.run",
        "prefixflow.schedule.stage",
        "prefixflow.schedule.caches",
        "prefixflow.schedule.phases",
        "prefixflow.schedule.stats",
        "prefixflow.schedule.validation",
        "prefixflow.schedule.driver",
    ],
    # what plugs into the schedule through hooks and build steps
    ["prefixflow.moe"],
    # checks: Table 3 alignment and its negative controls
    ["prefixflow.checks.alignment", "prefixflow.checks.faults"],
    # parallelism, the PP stage program and split-DP groups included: it runs the schedule's phases
    ["prefixflow.parallel"],
    ["prefixflow.rl"],
    # hf, trl and verl (verl imports verl only here; its tests run in .venv-verl)
    ["prefixflow.integrations", "prefixflow.integrations.trl", "prefixflow.integrations.verl"],
    ["prefixflow"],
]


# --- harness layers (bottom first) ---
# Each entry is a module or package name prefix (the longest matching prefix places a module). A module may
# import only its own layer or lower ones (function-local and TYPE_CHECKING imports included) and must not
# form a cycle within its layer. The order reads as the pipeline: spec -> run -> execute -> sweep -> cli.
HARNESS_LAYERS = [
    [
        "harness",
        "harness.safe_fs",
        "harness.peers",
        "harness.costmodel",
        "harness.figures",
        "harness.workloads",
        "harness.vision_workloads",
        "harness.vlm_models",
    ],
    ["harness.records", "harness.contenders", "harness.simulate"],
    ["harness.spec"],
    ["harness.run"],
    ["harness.execute", "harness.estimate"],
    # rollout_stats (pf-bench workload) reads pf-bench rl traces
    ["harness.sweep", "harness.capacity", "harness.rl", "harness.local_ranks", "harness.rollout_stats"],
    ["harness.cli", "harness.rl_precision"],
]
# --- end harness layers ---

LAYERS = PREFIXFLOW_LAYERS + HARNESS_LAYERS


def _modules() -> dict[str, Path]:
    mods = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


@dataclass(frozen=True)
class Import:
    """One module depending on another: ``module`` line ``line`` (``kind``) reaches ``target``."""

    module: str
    line: int
    target: str
    kind: str  # "module-level", "function-local" or "TYPE_CHECKING"
    via: str = ""  # how a name taken from a package reaches ``target``

    def __str__(self) -> str:
        via = f" (via {self.via})" if self.via else ""
        return f"{self.module}:{self.line} imports {self.target} [{self.kind}]{via}"


def _import_nodes(tree: ast.AST):
    """(import statement, kind) for every import in the file, wherever it sits."""
    todo: list[tuple[ast.AST, str]] = [(tree, "module-level")]
    while todo:
        node, kind = todo.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, kind
                continue
            inner = kind
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = "function-local" if kind == "module-level" else kind
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                inner = "TYPE_CHECKING"
            todo.append((child, inner))


class _Resolver:
    """Turns import statements into the repository modules they make Python run."""

    def __init__(self, mods: dict[str, Path]) -> None:
        self.mods = mods
        self._exports: dict[str, dict[str, tuple[str, str]]] = {}

    def is_package(self, mod: str) -> bool:
        return self.mods[mod].name == "__init__.py"

    def known(self, name: str) -> str | None:
        while name and name not in self.mods:
            name = name.rpartition(".")[0]
        return name or None

    def base_of(self, mod: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        package = mod.split(".") if self.is_package(mod) else mod.split(".")[:-1]
        parts = package[: len(package) - (node.level - 1)]
        return ".".join(parts + ([node.module] if node.module else []))

    def exports(self, package: str) -> dict[str, tuple[str, str]]:
        """Names the package's ``__init__`` binds by a module-level import: name -> (defining module, name)."""
        if package not in self._exports:
            found = {}
            for node, kind in _import_nodes(ast.parse(self.mods[package].read_text())):
                if kind != "module-level" or not isinstance(node, ast.ImportFrom):
                    continue
                base = self.base_of(package, node)
                for alias in node.names:
                    if alias.name != "*":
                        found[alias.asname or alias.name] = (base, alias.name)
            self._exports[package] = found
        return self._exports[package]

    def source_of(self, package: str, name: str, seen: tuple[str, ...] = ()) -> tuple[str, str]:
        """(module that defines ``package.name``, the re-export chain that leads there)."""
        if f"{package}.{name}" in self.mods:
            return f"{package}.{name}", ""
        bound = self.exports(package).get(name) if self.is_package(package) else None
        if bound is None or package in seen:
            return package, ""
        base, original = bound
        if f"{base}.{original}" in self.mods:
            return f"{base}.{original}", f"{package}.{name}"
        target = self.known(base)
        if target is None or target != base:  # bound from outside the repository
            return package, ""
        source, chain = self.source_of(target, original, (*seen, package))
        return source, f"{package}.{name}" + (f" -> {chain}" if chain else "")

    def imports(self, mod: str) -> list[Import]:
        own = {mod} | {mod.rsplit(".", i)[0] for i in range(1, mod.count(".") + 1)}
        found: list[Import] = []

        def add(node: ast.stmt, kind: str, target: str, via: str = "") -> None:
            # ``a.b.c`` runs the ``__init__`` of ``a`` and ``a.b`` first; the importer's own ones are running.
            chain = [target.rsplit(".", i)[0] for i in range(target.count("."), 0, -1)] + [target]
            for step in chain:
                if step in self.mods and (step == target or step not in own) and step != mod:
                    found.append(Import(mod, node.lineno, step, kind, via if step == target else ""))

        for node, kind in _import_nodes(ast.parse(self.mods[mod].read_text())):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = self.known(alias.name)
                    if target is not None:
                        add(node, kind, target)
                continue
            base = self.base_of(mod, node)
            target = self.known(base)
            if target is None:
                continue
            if target != base:  # ``from a.b import c`` where only ``a`` is ours: counts as ``a``
                add(node, kind, target)
                continue
            if not self.is_package(target) or target not in own:
                add(node, kind, target)
            for alias in node.names:
                if alias.name != "*" and self.is_package(target):
                    source, via = self.source_of(target, alias.name)
                    add(node, kind, source, via)
        return sorted(dict.fromkeys(found), key=lambda imp: imp.line)


def _all_imports() -> list[Import]:
    mods = _modules()
    resolver = _Resolver(mods)
    return [imp for mod in sorted(mods) for imp in resolver.imports(mod)]


def _entries_covering(mod: str) -> list[tuple[int, str]]:
    return [
        (layer, entry)
        for layer, entries in enumerate(LAYERS)
        for entry in entries
        if mod == entry or (entry not in PACKAGES and mod.startswith(entry + "."))
    ]


def _layer_of(mod: str) -> int | None:
    entries = _entries_covering(mod)
    return max(entries, key=lambda e: len(e[1]))[0] if entries else None


def _layer_name(layer: int) -> str:
    table, index = (
        ("PREFIXFLOW_LAYERS", layer)
        if layer < len(PREFIXFLOW_LAYERS)
        else ("HARNESS_LAYERS", layer - len(PREFIXFLOW_LAYERS))
    )
    return f"{table}[{index}] ({', '.join(LAYERS[layer])})"


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


def _upward(imports: list[Import], package: str) -> list[str]:
    bad = []
    for imp in imports:
        if not imp.module.startswith(package):
            continue
        mine, theirs = _layer_of(imp.module), _layer_of(imp.target)
        if mine is not None and theirs is not None and theirs > mine:
            bad.append(f"{imp}: {_layer_name(theirs)} is above {_layer_name(mine)}")
    return bad


def _cycles_in(imports: list[Import], package: str) -> list[str]:
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.module, set()).add(imp.target)
    found = []
    for component in _cycles(graph):
        if not component[0].startswith(package):
            continue
        members = set(component)
        edges = [str(imp) for imp in imports if imp.module in members and imp.target in members]
        found.append(f"cycle {component}:\n    " + "\n    ".join(edges))
    return found


def test_every_module_has_a_layer_and_every_entry_a_module():
    mods = _modules()
    unplaced = sorted(m for m in mods if _layer_of(m) is None)
    assert not unplaced, (
        f"modules with no layer (place each in PREFIXFLOW_LAYERS / HARNESS_LAYERS): {unplaced}"
    )
    entries = [e for layer in LAYERS for e in layer]
    duplicated = sorted({e for e in entries if entries.count(e) > 1})
    assert not duplicated, f"entries listed twice in the layer tables: {duplicated}"
    covering = {entry for m in mods for _, entry in _entries_covering(m)}
    stale = [e for e in entries if e not in covering]
    assert not stale, f"layer entries that cover no module (remove them): {stale}"


def test_prefixflow_imports_point_down():
    bad = _upward(_all_imports(), "prefixflow")
    assert not bad, "upward imports in prefixflow/:\n  " + "\n  ".join(bad)


def test_harness_imports_point_down():
    bad = _upward(_all_imports(), "harness")
    assert not bad, "upward imports in harness/:\n  " + "\n  ".join(bad)


def test_no_import_cycle_in_prefixflow():
    found = _cycles_in(_all_imports(), "prefixflow")
    assert not found, "import cycles in prefixflow/:\n  " + "\n  ".join(found)


def test_no_import_cycle_in_harness():
    found = _cycles_in(_all_imports(), "harness")
    assert not found, "import cycles in harness/:\n  " + "\n  ".join(found)


def test_prefixflow_never_imports_harness_and_core_never_imports_integrations():
    imports = _all_imports()
    to_harness = [
        str(i) for i in imports if i.module.startswith("prefixflow") and i.target.startswith("harness")
    ]
    assert not to_harness, "prefixflow/ imports harness/:\n  " + "\n  ".join(to_harness)
    to_integrations = [
        str(i)
        for i in imports
        if i.module.startswith("prefixflow")
        and not i.module.startswith("prefixflow.integrations")
        and i.target.startswith("prefixflow.integrations")
    ]
    assert not to_integrations, "the core imports prefixflow/integrations/:\n  " + "\n  ".join(
        to_integrations
    )


def test_the_checks_see_planted_imports(tmp_path, monkeypatch):
    """Each kind of import the checks must see, planted in a throwaway package (and the real tree is read)."""
    assert {(i.target, i.kind) for i in _all_imports() if i.module == "prefixflow.integrations.hf"} >= {
        ("prefixflow.model.adapters", "module-level")
    }
    package = tmp_path / "prefixflow"
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .top import helper\n",
        "low.py": "from . import helper\n",  # a re-export: really prefixflow.top
        "top.py": (
            "from typing import TYPE_CHECKING\n"
            "import prefixflow.sub.leaf\n"
            "if TYPE_CHECKING:\n    from .low import x\n"
            "def helper():\n    from . import low\n"
        ),
        "sub/__init__.py": "from .leaf import y as z\n",
        "sub/leaf.py": "y = 1\n",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", ("prefixflow",))
    got = {(i.module, i.line, i.target, i.kind, i.via) for i in _all_imports()}
    assert got == {
        ("prefixflow", 1, "prefixflow.top", "module-level", ""),
        ("prefixflow.low", 1, "prefixflow.top", "module-level", "prefixflow.helper"),
        ("prefixflow.top", 2, "prefixflow.sub", "module-level", ""),
        ("prefixflow.top", 2, "prefixflow.sub.leaf", "module-level", ""),
        ("prefixflow.top", 4, "prefixflow.low", "TYPE_CHECKING", ""),
        ("prefixflow.top", 6, "prefixflow.low", "function-local", ""),
        ("prefixflow.sub", 1, "prefixflow.sub.leaf", "module-level", ""),
    }
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
