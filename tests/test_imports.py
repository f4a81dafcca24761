"""The import graph of the product: no circles, arrows only along the data path, and the agent's public
parts (``meshscope.agent.PUBLIC``) are all that the trainer, the dashboard and the CLI import from it.

Every import counts, module-level or inside a function: a lazy import hides a circle from Python's import
machinery, not from a reader."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import meshscope.agent

ROOT = Path(__file__).resolve().parents[1]
# checkout folder -> installed package (pyproject's package-dir)
FOLDERS = {"agent": "meshscope.agent", "trainer": "meshscope.trainer", "dashboard": "meshscope.dashboard",
           "grafana": "meshscope.grafana", "meshscope": "meshscope", "tests/support": "tests.support"}
GENERIC = {"agent", "trainer", "dashboard", "streamlit_app", "meshscope_cli"}


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, pkg in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [x for x in path.relative_to(ROOT / folder).with_suffix("").parts if x != "__init__"]
            mods[".".join([pkg, *parts])] = path
    return mods


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """Every module name an import statement of the file names (``from p import m`` names p.m if that is a
    module of ours, else p)."""
    out = set()
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                   for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:  # annotations only: never imported at run time
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                       for a in node.names)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


GRAPH = {name: {m for m in _imports(path) if m in MODULES and m != name} for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    assert _cycles(GRAPH) == []


def _layer(name: str) -> str:
    for prefix in ("tests.support", "meshscope.agent", "meshscope.trainer", "meshscope.dashboard",
                   "meshscope.grafana"):
        if name == prefix or name.startswith(prefix + "."):
            return prefix
    return "meshscope"


def test_arrows_follow_the_data_path():
    """The agent imports neither the trainer nor the dashboard, and no product module imports the test
    helpers."""
    bad = sorted((a, b) for a, targets in GRAPH.items() for b in targets
                 if (_layer(a) == "meshscope.agent" and _layer(b) in ("meshscope.trainer", "meshscope.dashboard"))
                 or (_layer(a) != "tests.support" and _layer(b) == "tests.support"))
    assert bad == []


def test_the_trainer_and_the_dashboard_do_not_import_each_other():
    """The trainer is a user of the instrumentation, the dashboard a reader of the store: what both need
    (layout rules, model flavors, formulas) is in the contract, and a job launched by the dashboard's
    sweep is a command line, not an import."""
    bad = sorted((a, b) for a, targets in GRAPH.items() for b in targets
                 if {_layer(a), _layer(b)} == {"meshscope.trainer", "meshscope.dashboard"})
    assert bad == []


def test_the_store_imports_only_the_contract():
    """The run store is read by the dashboard, the CLI and the agent's catch-up alike: it depends on the
    contract (schema, names, paths) and on nothing that runs in a rank or in the node agent."""
    bad = sorted((a, b) for a, targets in GRAPH.items() if a.startswith("meshscope.agent.store") for b in targets
                 if b.startswith("meshscope.agent.") and not b.startswith(("meshscope.agent.store", "meshscope.agent.contract",
                                                                            "meshscope.agent.env")))
    assert bad == []


@pytest.mark.parametrize("layer", ["meshscope.trainer", "meshscope.dashboard", "meshscope"])
def test_the_rest_imports_only_the_agents_public_parts(layer):
    public = set(meshscope.agent.PUBLIC)
    bad = sorted((a, b) for a, targets in GRAPH.items() if _layer(a) == layer for b in targets
                 if _layer(b) == "meshscope.agent" and b not in public)
    assert bad == [], f"import a public module (meshscope.agent.PUBLIC) or make the module public: {bad}"


def test_the_public_parts_exist():
    assert set(meshscope.agent.PUBLIC) <= set(MODULES), set(meshscope.agent.PUBLIC) - set(MODULES)


def test_nothing_imports_the_generic_names():
    bad = sorted((name, m) for name, path in MODULES.items() for m in _imports(path) if m.split(".")[0] in GENERIC)
    assert bad == []
