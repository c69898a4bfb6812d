"""The package's import graph: no cycles, and dependencies that point one way.

Every ``import`` in ``src/barrierguard`` counts, wherever it stands: at the top,
inside a function, or under ``if TYPE_CHECKING:``. The layers, lowest first:

* the leaf modules ``_errors``, ``_env`` and ``_version``: anyone may import them;
* ``detect``, ``report`` and ``metrics``: each imports only the leaves;
* ``session``: imports ``detect`` and ``report``;
* ``integrations`` and ``cli`` (the adapters): import ``session`` and ``report``,
  never a module of ``detect``;
* the facade ``barrierguard/__init__.py`` and ``__main__``: import anything.

docs/architecture.md draws the same map.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "barrierguard"

LEAVES = {"_errors", "_env", "_version"}
LAYER = {
    "leaf": 0,
    "detect": 1,
    "report": 1,
    "metrics": 1,
    "session": 2,
    "integrations": 3,
    "cli": 3,
    "facade": 4,
}
ADAPTERS = {"integrations", "cli"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _imports(name: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """The barrierguard modules that ``name`` imports, with the line of each import."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if _is_package(name, modules) else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield (sub if sub in modules else target), node.lineno


def _graph() -> dict[str, dict[str, int]]:
    modules = _modules()
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        for target, line in _imports(name, path, modules):
            assert target in modules, f"{name}:{line} imports {target}, which does not exist"
            if target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def _part(name: str) -> str:
    """The layer part a module belongs to: a subpackage, ``leaf`` or ``facade``."""
    parts = name.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return "facade"
    if parts[1] in LEAVES:
        return "leaf"
    return parts[1]


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
            visit(v)
    return found


def test_every_module_belongs_to_a_known_part() -> None:
    unknown = {name for name in _modules() if _part(name) not in LAYER}
    assert not unknown, f"modules outside the layer map (add them to LAYER): {sorted(unknown)}"


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_dependencies_point_one_way() -> None:
    backward = []
    for name, edges in _graph().items():
        src = _part(name)
        for target, line in edges.items():
            dst = _part(target)
            if src == dst:
                continue
            if dst == "facade":
                backward.append(f"{name}:{line} imports the facade {target}; import its module")
            elif LAYER[dst] >= LAYER[src]:
                backward.append(f"{name}:{line} ({src}) imports {target} ({dst})")
            elif src in ADAPTERS and dst == "detect":
                backward.append(f"{name}:{line}: an adapter imports the detector {target}")
    assert not backward, "\n".join(backward)


def test_renderers_import_only_records() -> None:
    allowed = {"barrierguard.report.records", "barrierguard._errors"}
    bad = [
        f"{name} imports {target}"
        for name, edges in _graph().items()
        if name.startswith("barrierguard.report.render.")
        for target in edges
        if target not in allowed and not target.startswith("barrierguard.report.render.")
    ]
    assert not bad


def test_no_module_imports_another_parts_private_names() -> None:
    bad = []
    modules = _modules()
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not node.module or node.level:
                continue
            if node.module.split(".")[0] != PACKAGE or _part(node.module) == _part(name):
                continue
            for alias in node.names:
                if alias.name.startswith("_") and alias.name != "__version__":
                    if f"{node.module}.{alias.name}" in modules:
                        continue  # a leaf module such as barrierguard._errors
                    bad.append(f"{name}:{node.lineno} imports {node.module}.{alias.name}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    ("edges", "cycle"),
    [
        ({"a": {"b": 1}, "b": {"a": 1}}, [["a", "b"]]),
        ({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}, [["a", "b", "c"]]),
        ({"a": {"b": 1}, "b": {"c": 1}, "c": {}}, []),
    ],
)
def test_the_cycle_finder_finds_cycles(edges: dict[str, dict[str, int]], cycle: list[str]) -> None:
    assert _cycles(edges) == cycle


def test_the_import_reader_sees_function_level_and_type_only_imports(tmp_path: Path) -> None:
    modules = {"barrierguard.x": tmp_path / "x.py", "barrierguard.y": tmp_path / "y.py"}
    modules["barrierguard.x"].write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from barrierguard.y import Y\n"
        "def f():\n    from barrierguard import y\n"
    )
    found = list(_imports("barrierguard.x", modules["barrierguard.x"], modules))
    assert found == [("barrierguard.y", 3), ("barrierguard.y", 5)]
