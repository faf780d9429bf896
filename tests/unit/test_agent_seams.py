"""agent/: services depend on narrow interfaces, never on the server or each other's privates."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gpumesh.agent.deps import Handlers, RequestContext
from gpumesh.protocol.messages import Ping, Pong

AGENT = Path(__file__).resolve().parents[2] / "src" / "gpumesh" / "agent"
SERVICES = sorted(p for p in AGENT.glob("*.py") if p.stem not in ("server", "__init__"))


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """Every ``from X import a, b`` in the module, TYPE_CHECKING blocks and functions included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
    return found


@pytest.mark.parametrize("path", SERVICES, ids=lambda p: p.stem)
def test_no_service_imports_the_server_or_anothers_private_names(path: Path) -> None:
    for module, names in _imports(path):
        assert module != "gpumesh.agent.server", f"{path.name} imports the server"
        assert not (module == "gpumesh.agent" and "server" in names), path.name
        if module.startswith("gpumesh.agent."):
            private = [name for name in names if name.startswith("_")]
            assert private == [], f"{path.name} imports {private} from {module}"


@pytest.mark.parametrize("path", SERVICES, ids=lambda p: p.stem)
def test_no_service_reaches_through_the_agent(path: Path) -> None:
    text = path.read_text()
    for reach in ("self.agent", "ctx.agent", "files.agent", "jobs._owned"):
        assert reach not in text, f"{path.name} reaches through {reach}"


def test_a_message_type_has_one_handler_and_lookups_find_it() -> None:
    handlers = Handlers()

    async def ping(ctx: RequestContext, message: Ping) -> None:
        ctx.stream.send_message(Pong(sent=message.sent, time=0.0), end=True)

    handlers.add(Ping, ping)
    assert handlers.get(Ping) is ping and handlers[Ping] is ping
    assert handlers.get(Pong) is None and Pong not in handlers
    with pytest.raises(ValueError, match="Ping already has a handler"):
        handlers.add(Ping, ping)
