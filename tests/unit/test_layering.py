"""The layers of docs/architecture.md, checked on the source: floors, folders, cycles.

Every module under ``src/gpumesh`` is parsed (never imported) and put on a
floor, from the bottom:

0. base: the small shared modules at the top of the package (``errors.py``,
   ``units.py``, ``settings.py``, ``blocking.py``): identity and protocol raise
   the one error tree, so it sits under them;
1. ``identity/``;
2. ``protocol/``;
3. ``transport/``, ``store/``, ``runtime/``, ``gpu/``, ``files/``;
4. ``client/``, ``agent/``;
5. ``cli/``, ``daemon/``, ``control/`` and the package's faces: its root
   (``gpumesh/__init__.py``, the public API), ``__main__.py`` and ``cuda.py``
   (``from gpumesh.cuda import RemoteDevice``).

Features are layered, never folders of their own (:data:`LAYERS`): CUDA
remoting and the desktop tunnel, like jobs and files, have a module on each
floor they need (``protocol/cuda.py``, ``gpu/cuda*.py``, ``agent/cuda*.py``,
``client/cuda*.py``, ``cli/cuda.py``; ``protocol/desktop.py``,
``agent/desktop.py``, ``client/desktop.py``, ``cli/desktop.py``).

``relay/`` is a top of its own (``gpumesh-relay``): it may use floors 0 to 3,
nothing else imports it, and it never imports ``client/``, ``agent/``, ``cli/``,
``control/`` or the package root. ``registry/`` (``gpumesh-registry``) is
a top in the same way.

Along a floor the folders are in order too (:data:`FOLDER_ORDER`, lowest first):
a folder imports at run time only folders before it on its floor, never one
after it:

3. ``runtime/``, ``store/``, ``gpu/``, ``files/``, ``transport/`` (the data
   channel hashes a file's head with ``files/``' helper);
4. ``client/``, ``agent/``: the provider never uses the consumer's side;
5. ``control/``, ``daemon/``, ``cli/``: the node process (``daemon/``) serves
   the control API and hands the routes what it owns (its share, its shells)
   in ``ControlState``, so ``control/`` names those only for type checking;
   ``gpumesh-control`` is the node process in the foreground
   (``daemon/main.py``); the CLI talks to the node process.

``relay/`` and ``registry/`` never import each other.

Four checks:

* no module imports from a higher floor, whether at run time or only for type
  checking (under ``if TYPE_CHECKING:``), which may reach along a floor but
  not up;
* no import cycle at run time: module-level and function-local imports are
  edges, ``TYPE_CHECKING``-only ones are not; every strongly connected group
  of more than one module is reported with the imports that close it;
* no circle between folders at run time: the same edges, each taken from its
  module's folder to its target's; every strongly connected group of more
  than one folder is reported with the module imports that close it;
* no run-time import along a floor against :data:`FOLDER_ORDER`.

Imports by name through ``importlib`` (the CLI's lazy command table, the
package root's lazy attributes) are not seen; both point down or along.
A new top-level folder has no floor until it is given one here.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "gpumesh"

BASE, IDENTITY, PROTOCOL, SERVICES, OPERATIONS, FACES = range(6)
RELAY = -1
"""Not a rung of the ladder: a top of its own."""

FLOORS = {
    "identity": IDENTITY,
    "protocol": PROTOCOL,
    "transport": SERVICES,
    "store": SERVICES,
    "runtime": SERVICES,
    "gpu": SERVICES,
    "files": SERVICES,
    "client": OPERATIONS,
    "agent": OPERATIONS,
    "cli": FACES,
    "control": FACES,
    "daemon": FACES,
    "relay": RELAY,
    "registry": RELAY,
}
"""Each folder of the package and its floor; a top-level module is on BASE."""

FACES_AT_THE_TOP = ("__main__", "cuda")
"""Top-level modules that are faces of the package (floor 5), not base modules."""

LAYERS = frozenset(FLOORS)
"""The folders of the package: layers and the two tops, never a feature's folder."""

FOLDER_ORDER = {
    IDENTITY: ("identity",),
    PROTOCOL: ("protocol",),
    SERVICES: ("runtime", "store", "gpu", "files", "transport"),
    OPERATIONS: ("client", "agent"),
    FACES: ("control", "daemon", "cli"),
}
"""The folders of each floor, lowest first: one imports at run time only those before it.
The relay floor has no order: its tops never import each other."""

FLOOR_NAMES = {
    BASE: "base",
    IDENTITY: "identity",
    PROTOCOL: "protocol",
    SERVICES: "transport/store/runtime/gpu/files",
    OPERATIONS: "client/agent",
    FACES: "cli/control/package root",
    RELAY: "relay",
}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    type_only: bool
    """Under ``if TYPE_CHECKING:``: for the type checker, never run."""


def modules(src: Path = SRC, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of ``package`` under ``src`` by dotted name (a package by its own)."""
    found: dict[str, Path] = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def floor_of(module: str, package: str = PACKAGE) -> int | None:
    """The floor of ``module``; None for a folder that has none yet."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in FACES_AT_THE_TOP:
        return FACES
    if len(parts) == 2 and parts[1] not in FLOORS:
        return BASE if not _is_folder(module) else None
    return FLOORS.get(parts[1])


def _is_folder(module: str) -> bool:
    return (SRC / module.replace(".", "/")).is_dir()


def edges(known: dict[str, Path], package: str = PACKAGE) -> Iterator[Edge]:
    """Each import of one module of ``known`` by another, with where it stands."""
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        for node, type_only in _imports(tree.body, type_only=False):
            # one edge per module a statement names, however many names it takes
            for target in dict.fromkeys(_targets(node, name, is_package, known, package)):
                if target != name:
                    yield Edge(name, target, node.lineno, type_only)


def _imports(
    body: list[ast.stmt], *, type_only: bool
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement in ``body``, nested ones too, and whether it is type-only."""
    for statement in body:
        if isinstance(statement, ast.Import | ast.ImportFrom):
            yield statement, type_only
        elif isinstance(statement, ast.If) and _is_type_checking(statement.test):
            yield from _imports(statement.body, type_only=True)
            yield from _imports(statement.orelse, type_only=type_only)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                inner = getattr(statement, field, None)
                if isinstance(inner, list):
                    # statements, or the bodies of except handlers and match cases
                    nested = [s for s in inner if isinstance(s, ast.stmt)]
                    nested += [s for h in inner if not isinstance(h, ast.stmt) for s in h.body]
                    yield from _imports(nested, type_only=type_only)


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _targets(
    node: ast.Import | ast.ImportFrom,
    module: str,
    is_package: bool,
    known: dict[str, Path],
    package: str,
) -> list[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
        return [_known(name, known) for name in names if _inside(name, package)]
    base = node.module or ""
    if node.level:
        parts = module.split(".")
        if not is_package:
            parts.pop()
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join([*parts, base] if base else parts)
    if not _inside(base, package):
        return []
    targets = []
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        targets.append(submodule if submodule in known else _known(base, known))
    return targets


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _known(name: str, known: dict[str, Path]) -> str:
    """The module ``name`` is, or the nearest package above it that exists."""
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def floor_violations(found: list[Edge]) -> list[str]:
    """One line per import that goes up a floor, or into or out of relay/ wrongly."""
    problems = []
    for edge in found:
        source, target = floor_of(edge.source), floor_of(edge.target)
        if source is None or target is None:
            continue  # reported by the test that every folder has a floor
        how = "for type checking only" if edge.type_only else "at run time"
        where = f"{edge.source} ({FLOOR_NAMES[source]}) imports {edge.target}"
        where += f" ({FLOOR_NAMES[target]}) {how}, line {edge.line}"
        if source == RELAY and target != RELAY and target > SERVICES:
            problems.append(f"{where}: relay/ never imports {FLOOR_NAMES[target]}")
        elif target == RELAY and source != RELAY:
            problems.append(f"{where}: relay/ is a top of its own, nothing imports it")
        elif source != RELAY and target > source:
            problems.append(f"{where}: a higher floor")
    return problems


def cycles(found: list[Edge]) -> list[list[str]]:
    """The strongly connected groups of more than one module in the run-time graph."""
    graph: dict[str, set[str]] = {}
    for edge in found:
        if not edge.type_only:
            graph.setdefault(edge.source, set()).add(edge.target)
            graph.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(start: str) -> None:
        # Tarjan's algorithm, iterative: the graph is a hundred modules deep at most,
        # but recursion limits should not decide a test.
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(groups)


def describe_cycle(group: list[str], found: list[Edge]) -> str:
    members = set(group)
    inside = sorted(
        {
            f"{e.source} -> {e.target} (line {e.line})"
            for e in found
            if not e.type_only and e.source in members and e.target in members
        }
    )
    return f"{', '.join(group)}\n      " + "\n      ".join(inside)


def folder_of(module: str, folders: Collection[str] = FLOORS) -> str | None:
    """The top-level folder ``module`` is in; None for the package root and the base."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and parts[1] in folders):
        return parts[1]
    return None


def _between_folders(found: list[Edge], folders: Collection[str]) -> list[Edge]:
    """The run-time edges from a module of one folder to a module of another."""
    crossing = []
    for edge in found:
        source, target = folder_of(edge.source, folders), folder_of(edge.target, folders)
        if not edge.type_only and source and target and source != target:
            crossing.append(edge)
    return crossing


def folder_cycles(found: list[Edge], folders: Collection[str] = FLOORS) -> list[list[str]]:
    """The strongly connected groups of more than one folder in the run-time graph."""
    # one edge per pair of folders, named by the folders alone
    pairs = {
        (folder_of(e.source, folders), folder_of(e.target, folders))
        for e in _between_folders(found, folders)
    }
    return cycles([Edge(str(source), str(target), 0, False) for source, target in pairs])


def describe_folder_cycle(
    group: list[str], found: list[Edge], folders: Collection[str] = FLOORS
) -> str:
    members = set(group)
    inside = sorted(
        {
            f"{e.source} -> {e.target} (line {e.line})"
            for e in _between_folders(found, folders)
            if folder_of(e.source, folders) in members and folder_of(e.target, folders) in members
        }
    )
    return f"{', '.join(group)}\n      " + "\n      ".join(inside)


def order_violations(found: list[Edge]) -> list[str]:
    """One line per run-time import along a floor that goes against :data:`FOLDER_ORDER`."""
    problems = []
    for edge in _between_folders(found, FLOORS):
        source, target = folder_of(edge.source), folder_of(edge.target)
        if source not in FLOORS or target not in FLOORS:
            continue  # reported by the test that every folder has a floor
        floor = FLOORS[source]
        if FLOORS[target] != floor:
            continue  # across floors: the floor rule's
        order = FOLDER_ORDER.get(floor, ())
        if source in order and target in order and order.index(target) < order.index(source):
            continue
        where = f"{edge.source} imports {edge.target} at run time, line {edge.line}"
        if floor == RELAY:
            problems.append(f"{where}: {source}/ and {target}/ never import each other")
        else:
            problems.append(f"{where}: {target}/ comes after {source}/ in {' < '.join(order)}")
    return problems


# --- the checks on src/gpumesh --------------------------------------------------------


def _source_edges() -> list[Edge]:
    return list(edges(modules()))


def test_every_folder_of_the_package_has_a_floor() -> None:
    missing = sorted(
        {m.split(".")[1] for m in modules() if m.count(".") >= 1 and floor_of(m) is None}
    )
    assert not missing, f"give these folders a floor in FLOORS: {missing}"


def test_features_are_layered_not_folders_of_their_own() -> None:
    folders = {m.split(".")[1] for m in modules() if m.count(".") >= 1 and _is_folder(m)}
    assert folders == LAYERS, (
        f"a feature gets a module in each layer it needs, not a folder: {sorted(folders - LAYERS)}"
    )
    assert {"cuda", "desktop"}.isdisjoint(LAYERS)


def test_no_module_imports_from_a_higher_floor() -> None:
    problems = floor_violations(_source_edges())
    if problems:
        pytest.fail(
            f"{len(problems)} imports go up a floor (floors: this module's docstring):\n  "
            + "\n  ".join(problems),
            pytrace=False,
        )


def test_no_import_cycle_at_run_time() -> None:
    found = _source_edges()
    groups = cycles(found)
    if groups:
        pytest.fail(
            f"{len(groups)} groups of modules import each other at run time "
            "(a TYPE_CHECKING import is not a cycle; a function-local import is):\n  "
            + "\n  ".join(describe_cycle(group, found) for group in groups),
            pytrace=False,
        )


def test_every_folder_has_its_place_along_its_floor() -> None:
    ordered = {folder: floor for floor, order in FOLDER_ORDER.items() for folder in order}
    placed = {folder: floor for folder, floor in FLOORS.items() if floor != RELAY}
    assert ordered == placed, "each folder of FLOORS is in FOLDER_ORDER, on its own floor"


def test_no_circle_between_folders_at_run_time() -> None:
    found = _source_edges()
    groups = folder_cycles(found)
    if groups:
        pytest.fail(
            f"{len(groups)} groups of folders import each other at run time "
            "(a function-local import counts, a TYPE_CHECKING one does not):\n  "
            + "\n  ".join(describe_folder_cycle(group, found) for group in groups),
            pytrace=False,
        )


def test_folders_along_a_floor_import_in_order() -> None:
    problems = order_violations(_source_edges())
    if problems:
        pytest.fail(
            f"{len(problems)} imports go against the order along a floor "
            "(FOLDER_ORDER, this module's docstring):\n  " + "\n  ".join(problems),
            pytrace=False,
        )


# --- the checker itself, on a made-up package -----------------------------------------


def _write(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return modules(root, "pkg")


def test_the_checker_sees_every_kind_of_import(tmp_path: Path) -> None:
    known = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/errors.py": "",
            "pkg/a/__init__.py": "from . import one\n",
            "pkg/a/one.py": (
                "from typing import TYPE_CHECKING\n"
                "import pkg.errors\n"
                "from .two import thing\n"
                "if TYPE_CHECKING:\n"
                "    from pkg.b import other\n"
                "else:\n"
                "    import os\n"
                "def late():\n"
                "    try:\n"
                "        from ..b.other import name\n"
                "    except ImportError:\n"
                "        pass\n"
            ),
            "pkg/a/two.py": "import json\nfrom pkg import errors\n",
            "pkg/b/__init__.py": "",
            "pkg/b/other.py": "from pkg.a.one import late\n",
        },
    )
    found = {(e.source, e.target, e.type_only) for e in edges(known, "pkg")}
    assert found == {
        ("pkg.a", "pkg.a.one", False),
        ("pkg.a.one", "pkg.errors", False),
        ("pkg.a.one", "pkg.a.two", False),
        ("pkg.a.one", "pkg.b.other", True),
        ("pkg.a.one", "pkg.b.other", False),
        ("pkg.a.two", "pkg.errors", False),
        ("pkg.b.other", "pkg.a.one", False),
    }
    every = list(edges(known, "pkg"))
    assert cycles(every) == [["pkg.a.one", "pkg.b.other"]]
    assert describe_cycle(["pkg.a.one", "pkg.b.other"], every).splitlines() == [
        "pkg.a.one, pkg.b.other",
        "      pkg.a.one -> pkg.b.other (line 10)",
        "      pkg.b.other -> pkg.a.one (line 1)",
    ]
    # the late import closes the cycle; the TYPE_CHECKING one alone would not
    late = ("pkg.a.one", "pkg.b.other", False)
    assert cycles([e for e in every if (e.source, e.target, e.type_only) != late]) == []


def test_the_floor_rule_reads_each_direction() -> None:
    def edge(source: str, target: str, type_only: bool = False) -> Edge:
        return Edge(source, target, 1, type_only)

    assert (
        floor_violations(
            [
                edge("gpumesh.identity.keys", "gpumesh.errors"),
                edge("gpumesh.transport.quic", "gpumesh.store.db"),
                edge("gpumesh.client.jobs", "gpumesh.agent.server", type_only=True),
                edge("gpumesh.cli.run", "gpumesh.client.jobs"),
                edge("gpumesh.relay.core", "gpumesh.transport.udp"),
            ]
        )
        == []
    )
    problems = floor_violations(
        [
            edge("gpumesh.errors", "gpumesh.identity.keys"),
            edge("gpumesh.store.db", "gpumesh.client.node", type_only=True),
            edge("gpumesh.agent.server", "gpumesh"),
            edge("gpumesh.relay.main", "gpumesh.agent.jobs"),
            edge("gpumesh.transport.session", "gpumesh.relay.core"),
        ]
    )
    assert [p.split(" imports ")[0] for p in problems] == [
        "gpumesh.errors (base)",
        "gpumesh.store.db (transport/store/runtime/gpu/files)",
        "gpumesh.agent.server (client/agent)",
        "gpumesh.relay.main (relay)",
        "gpumesh.transport.session (transport/store/runtime/gpu/files)",
    ]
    assert "for type checking only, line 1: a higher floor" in problems[1]


def test_the_folder_checks_see_a_circle_closed_by_late_imports() -> None:
    def edge(source: str, target: str, type_only: bool = False) -> Edge:
        return Edge(source, target, 7, type_only)

    # control <-> daemon, and client -> agent -> cuda -> client, as they once were:
    # no module cycle, but function-local imports close circles between folders
    found = [
        edge("gpumesh.control.app", "gpumesh.daemon.shells"),
        edge("gpumesh.daemon.process", "gpumesh.control.app", type_only=True),
        edge("gpumesh.daemon.process", "gpumesh.control.server"),
        edge("gpumesh.client.doctor", "gpumesh.agent.limits"),
        edge("gpumesh.agent.cuda", "gpumesh.cuda.protocol"),
        edge("gpumesh.cuda.device", "gpumesh.client.node"),
        edge("gpumesh.cli.run", "gpumesh.client.jobs"),
        edge("gpumesh.client.jobs", "gpumesh.errors"),
    ]
    assert cycles(found) == []
    assert folder_cycles(found) == [["agent", "client", "cuda"], ["control", "daemon"]]
    assert describe_folder_cycle(["control", "daemon"], found).splitlines() == [
        "control, daemon",
        "      gpumesh.control.app -> gpumesh.daemon.shells (line 7)",
        "      gpumesh.daemon.process -> gpumesh.control.server (line 7)",
    ]
    assert [p.split(" at run time")[0] for p in order_violations(found)] == [
        "gpumesh.control.app imports gpumesh.daemon.shells",
        "gpumesh.client.doctor imports gpumesh.agent.limits",
    ]
    # a type-only import along a floor closes nothing and breaks no order
    late = [edge("gpumesh.daemon.process", "gpumesh.control.app", type_only=True)]
    assert folder_cycles(late) == [] and order_violations(late) == []
    assert order_violations([edge("gpumesh.relay.core", "gpumesh.registry.store")]) == [
        "gpumesh.relay.core imports gpumesh.registry.store at run time, line 7: "
        "relay/ and registry/ never import each other"
    ]
