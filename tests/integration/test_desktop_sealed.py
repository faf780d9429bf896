"""Sealed frames on a desktop connection's data channel, and peers that predate them.

Real nodes on loopback, a plain TCP server of the test's own as the desktop. A
peer one version behind is this code with its sealed-frame version set to 0:
what it sends then (``DesktopOpen`` without ``framing``, ``DesktopOpened``
without it) decodes exactly as an older peer's messages do, and it runs the
TLS-records path an older peer runs. Which framing carried a connection is read
from the provider's session (what both ends agreed), never from timing; that
the bytes arrive whole shows both ends switched (or both did not).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Callable

import pytest

from gpumesh.client import desktop as client_desktop
from gpumesh.client.desktop import allow_desktop, share_desktop
from gpumesh.client.node import Node
from gpumesh.protocol.desktop import DesktopKind
from gpumesh.transport.sealing import FRAMING_VERSION
from tests.integration.conftest import arun, pair_both, sharing
from tests.integration.test_desktop_tunnel import (
    CEILING,
    _hash_then_reply,
    _serve_desktop,
    _tunnel,
    _wait_for,
)


@pytest.fixture
def nodes(make_node: Callable[[str], Node]) -> tuple[Node, Node]:
    return make_node("alice-pc"), make_node("bob-laptop")


@pytest.mark.parametrize(
    ("consumer", "provider", "agreed"),
    [
        (FRAMING_VERSION, FRAMING_VERSION, FRAMING_VERSION),
        (0, FRAMING_VERSION, 0),  # a consumer one version behind
        (FRAMING_VERSION, 0, 0),  # a provider one version behind
    ],
    ids=["both-sealed", "old-consumer", "old-provider"],
)
def test_framing_is_agreed_and_every_byte_arrives(
    nodes: tuple[Node, Node],
    monkeypatch: pytest.MonkeyPatch,
    consumer: int,
    provider: int,
    agreed: int,
) -> None:
    alice, bob = nodes
    monkeypatch.setattr(client_desktop, "FRAMING", consumer)
    payload = os.urandom(3 * 1024 * 1024 + 5)
    paths: list[str] = []

    async def scenario() -> None:
        server, port = await _serve_desktop(_hash_then_reply)
        async with sharing(alice) as agent:
            agent.desktop.framing = provider
            pair_both(alice, bob)
            allow_desktop(alice, "bob-laptop")
            share_desktop(alice, DesktopKind.RDP, port)
            async with _tunnel(bob, carried=paths.append) as (ready, _task):
                reader, writer = await asyncio.open_connection("127.0.0.1", ready.port)
                await _wait_for(lambda: len(agent.desktop.sessions()) == 1)
                [session] = agent.desktop.sessions()
                assert (session.path, session.framing) == ("channel", agreed)
                writer.write(payload)
                await writer.drain()
                writer.write_eof()  # the half-close: the server answers after it
                answer = await asyncio.wait_for(reader.read(), CEILING * 3)
                writer.close()
                digest = hashlib.sha256(payload).hexdigest()
                assert answer == f"{len(payload)} {digest}\n".encode()
        server.close()
        assert paths == ["channel"]

    arun(scenario())
