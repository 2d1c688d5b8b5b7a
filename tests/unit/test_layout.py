"""The house plan, checked: layers point one way, no wing of gyre.actors imports another, no import circle, and each
package's public names are exactly those pinned here (trio's test_exports: a public name changes on purpose).

Imports are read from the source (ast), everywhere in a file, `if TYPE_CHECKING:` blocks and function bodies
included: a circle that only typing sees is still a circle in the design.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("messages", "runtime", "engines", "policies", "actors", "benchmarks", "simulate")
WINGS = ("serving", "cells", "training", "executions")

#: What each layer may import from gyre (besides itself). Policies import only messages and plain data, plus the
#: error base (gyre.runtime.errors depends on nothing). benchmarks sit on top and may import every layer.
ALLOWED = {
    "messages": {"messages"},
    "runtime": {"messages", "runtime"},
    "engines": {"messages", "runtime", "engines"},
    "policies": {"messages", "policies", "runtime.errors"},
    "actors": {"messages", "runtime", "engines", "policies", "actors"},
    "benchmarks": {"messages", "runtime", "engines", "policies", "actors", "benchmarks"},
    # gyre simulate composes actors of several wings with emulated ones, so it sits above the actors.
    "simulate": {"messages", "runtime", "engines", "policies", "actors", "benchmarks", "simulate"},
}

#: Circles that stay, each with its reason.
ALLOWED_CIRCLES: dict[frozenset[str], str] = {
    frozenset({"gyre.runtime.actor", "gyre.runtime.node", "gyre.runtime.topology"}):
        "Actor annotates its slot (runtime.node.ActorSlot) under TYPE_CHECKING only; node and topology host actors",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return "gyre." + ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(f): f for package in PACKAGES for f in sorted((ROOT / package).rglob("*.py"))}


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("gyre.") or name == "gyre"}


MODULES = _modules()
IMPORTS = {name: _imports(path) for name, path in MODULES.items()}


def _layer(module: str) -> str:
    return module.split(".")[1]


def _allowed(importer: str, imported: str) -> bool:
    target = imported.removeprefix("gyre.")
    return any(target == allowed or target.startswith(allowed + ".") for allowed in ALLOWED[_layer(importer)])


def test_layers_point_one_way() -> None:
    wrong = sorted(
        f"{module} imports {imported}"
        for module, imported_names in IMPORTS.items()
        for imported in imported_names
        if imported in MODULES or imported.rsplit(".", 1)[0] in MODULES
        if not _allowed(module, imported)
    )
    assert wrong == []


def test_nothing_imports_examples() -> None:
    assert not [(m, i) for m, names in IMPORTS.items() for i in names if i.startswith("gyre.examples")]


def test_no_wing_imports_another() -> None:
    wrong = []
    for module, imported_names in IMPORTS.items():
        parts = module.split(".")
        if len(parts) < 3 or parts[1] != "actors" or parts[2] not in WINGS:
            continue
        for imported in imported_names:
            target = imported.split(".")
            if len(target) >= 3 and target[1] == "actors" and target[2] in WINGS and target[2] != parts[2]:
                wrong.append(f"{module} imports {imported}")
    assert wrong == []


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, imported_names in IMPORTS.items():
        edges = set()
        for imported in imported_names:
            if imported in MODULES:
                edges.add(imported)
            elif imported.rsplit(".", 1)[0] in MODULES:
                edges.add(imported.rsplit(".", 1)[0])
        # A package's __init__ is not an edge into its own modules' circle (the lazy wing exports import nothing).
        graph[module] = {edge for edge in edges if edge != module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[frozenset[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_no_import_circle() -> None:
    circles = [sorted(c) for c in _circles(_graph()) if c not in ALLOWED_CIRCLES]
    assert circles == []


def test_the_circle_finder_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset({"a", "b", "c"})]


#: package -> its public names. Change a package's __all__ and this table together, on purpose.
PUBLIC = {
    "gyre.actors": [],
    "gyre.actors.serving": ["Proxy", "ProxyConfig", "ProxyHttpConfig", "ProxySessionsConfig", "RoutingConfig"],
    "gyre.actors.cells": ["Cell", "CellConfig", "KVMigrator", "KVMigratorConfig", "WeightBroker",
                          "WeightBrokerConfig"],
    "gyre.actors.training": ["Checkpointer", "CheckpointerConfig", "ClaimerConfig", "MicroStepClaimer", "RunMonitor", "RunMonitorConfig", "Scheduler",
                             "SchedulerConfig", "TrajectoryBuilder", "TrajectoryBuilderConfig"],
    "gyre.actors.executions": ["Evaluator", "EvaluatorConfig", "Executor", "ExecutorConfig", "TaskSource",
                               "TaskSourceConfig"],
    "gyre.benchmarks": [],
    "gyre.benchmarks.studies": [],
    "gyre.simulate": ["CellModel", "EmulatedAgents", "EmulatedCell", "HARDWARE", "ModelProfile", "Setup", "WORKLOADS",
                      "Workload", "compare", "lower_bound"],
    "gyre.messages": ["REGISTERED", "message"],
}


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_public_names_are_pinned(package: str) -> None:
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(PUBLIC[package])
    for name in module.__all__:
        assert getattr(module, name) is not None
    assert set(PUBLIC[package]) <= set(dir(module))


def test_each_wing_exports_its_actors() -> None:
    from gyre.runtime import Actor

    for wing in WINGS:
        package = importlib.import_module(f"gyre.actors.{wing}")
        exported = {getattr(package, name) for name in package.__all__}
        for module_name in (m for m in MODULES if m.startswith(f"gyre.actors.{wing}.")):
            module = importlib.import_module(module_name)
            for value in vars(module).values():
                if isinstance(value, type) and issubclass(value, Actor) and value.__module__ == module_name:
                    assert value in exported, f"{module_name}.{value.__name__} is not exported by {package.__name__}"
