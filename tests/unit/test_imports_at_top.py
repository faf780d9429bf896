"""Start-up tricks stay at one boundary; everywhere else imports sit at the top.

The boundary is the thin client: the CLI (``cli/``, whose command modules
load lazily and import what a command needs when it runs, so that a command
that talks to the node process never loads the client layer), the Python
API's ``Mesh`` (whose methods load their operation when called), the node
process's client and what it looks up (:data:`BOUNDARY_MODULES`), and the
lazy attributes of a package (a module-level ``__getattr__``). Anywhere else a
function-local import is refused, except of an optional extra (``cuda``, the
registry's database drivers) or a module one platform lacks (``fcntl`` on
Windows), which may be missing when the function is never called; an import
guarded by ``except ImportError`` is such an optional one too. Two subsystems
a process may never use load where first used (:data:`ON_FIRST_USE`): FEC's
numpy and the provider, for the node process's memory.

No module declares its own ``TYPE_CHECKING``: ``typing``'s is the one.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "gpumesh"

BOUNDARY_FOLDERS = ("cli",)
BOUNDARY_MODULES = {
    "client/mesh.py",  # the Python API's Mesh: each method loads its operation
    "daemon/mesh.py",  # ...and the same Mesh through the node process
    "daemon/client.py",  # the node process's client, loaded by every thin command
    "daemon/__init__.py",  # the check of $GPUMESH_NODE every command makes first
    "store/sockets.py",  # the node process's socket name, which the thin client looks up
}
MAY_BE_MISSING = {
    # optional extras (pyproject's [project.optional-dependencies])
    "cuda", "sqlalchemy", "asyncpg", "httptools", "uvloop",
    # what one platform lacks
    "fcntl", "termios", "tty", "resource", "msvcrt", "winreg", "pwd", "grp",
}  # fmt: skip


ON_FIRST_USE = {
    # parity is made or repaired only on a link that loses packets: numpy's ~16 MB
    # stay out of a process whose links never do
    ("protocol/fec.py", "numpy"),
    # the provider (Docker's client, NVML, the services) loads when a share starts:
    # a node process that only consumes never holds it
    ("daemon/sharing.py", "gpumesh.agent.server"),
}
"""Subsystems a process may never use, loaded where first used (memory, not start-up)."""


def _in_boundary(relative: str) -> bool:
    return relative.split("/", maxsplit=1)[0] in BOUNDARY_FOLDERS or relative in BOUNDARY_MODULES


def _roots(node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name.split(".")[0] for alias in node.names}
    return {"gpumesh"} if node.level else {(node.module or "").split(".")[0]}


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    kinds = handler.type
    names = kinds.elts if isinstance(kinds, ast.Tuple) else [kinds]
    return any(
        isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names
    )


def _names(node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    return {node.module or ""}


def local_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import inside a function body that is neither optional nor guarded;
    a module-level ``__getattr__`` (a package's lazy attributes) is left alone."""

    def visit(
        node: ast.AST, in_function: bool, guarded: bool
    ) -> Iterator[ast.Import | ast.ImportFrom]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                if in_function and not guarded and not (_roots(child) & MAY_BE_MISSING):
                    yield child
                continue
            inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.FunctionDef) and node is tree and child.name == "__getattr__":
                continue
            shielded = guarded or (
                isinstance(child, ast.Try) and any(map(_catches_import_error, child.handlers))
            )
            yield from visit(child, inner, shielded)

    yield from visit(tree, False, False)


def _sources() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text(), str(path))


def test_imports_outside_the_boundary_sit_at_the_top() -> None:
    found = [
        f"{relative}:{node.lineno}: {ast.unparse(node)}"
        for relative, tree in _sources()
        if not _in_boundary(relative)
        for node in local_imports(tree)
        if not any((relative, name) in ON_FIRST_USE for name in _names(node))
    ]
    assert found == [], "imports inside functions outside the thin client:\n" + "\n".join(found)


def test_no_module_declares_its_own_type_checking() -> None:
    found = [
        f"{relative}:{node.lineno}"
        for relative, tree in _sources()
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign | ast.AnnAssign)
        and any(
            isinstance(target, ast.Name) and target.id == "TYPE_CHECKING"
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        )
    ]
    assert found == []


def test_the_check_sees_a_local_import_and_lets_the_allowed_ones_pass() -> None:
    """The checker itself: what it must refuse, and what it must leave."""
    source = (
        "import os\n"
        "def __getattr__(name):\n"
        "    import importlib\n"
        "def f():\n"
        "    import json\n"
        "    from gpumesh.errors import ConfigError\n"
        "    import fcntl\n"
        "    try:\n"
        "        import uvloop\n"
        "        import yaml\n"
        "    except ImportError:\n"
        "        pass\n"
        "class C:\n"
        "    def m(self):\n"
        "        from . import units\n"
    )
    refused = [ast.unparse(n) for n in local_imports(ast.parse(source))]
    assert refused == [
        "import json",
        "from gpumesh.errors import ConfigError",
        "from . import units",
    ]
