"""transport/: the relay plugs into the endpoint through the endpoint's protocols,
and no module of the package imports another that imports it back (imports for
type checking and inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import gpumesh.transport

PACKAGE = Path(gpumesh.transport.__file__).parent


def _imports(path: Path) -> set[str]:
    """The transport modules ``path`` imports, wherever the import statement is."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            inside = parts[:2] == ["gpumesh", "transport"] and len(parts) > 2
            if inside and (PACKAGE / f"{parts[2]}.py").exists():
                found.add(parts[2])
    return found - {path.stem}


def _graph() -> dict[str, set[str]]:
    return {p.stem: _imports(p) for p in PACKAGE.glob("*.py") if p.stem != "__init__"}


def test_the_endpoint_names_no_relay_client() -> None:
    assert "relayclient" not in _graph()["quic"]
    assert "quic" not in _graph()["stream"]


def test_no_import_cycle_in_transport() -> None:
    graph = _graph()
    done: set[str] = set()

    def visit(module: str, trail: list[str]) -> None:
        assert module not in trail, " -> ".join([*trail, module])
        if module in done:
            return
        for imported in sorted(graph[module]):
            visit(imported, [*trail, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
