"""Sealed frames on a desktop connection's data channel, and peers that predate them.

Real nodes on loopback, a plain TCP server of the test's own as the desktop. A
peer from before sealed frames is this code with its sealed-frame version set
to 0: what it sends then (``DesktopOpen`` without ``sealing``, ``DesktopOpened``
without it) decodes exactly as an older peer's messages do, and it runs the
TLS-records path an older peer runs. A consumer of version 1 (keys bound to the
channel's ``tls-unique``) is played by sending its very offer, ``framing: 1``;
a provider of version 1 read only that field, so the offers this code sends
are checked to leave it 0. Which framing carried a connection is read from the
provider's session (what both ends agreed), never from timing; that the bytes
arrive whole shows both ends switched (or both did not).
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
from gpumesh.protocol.messages import DesktopOpen
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


def _as_version_1(channel: bool, sealing: int) -> DesktopOpen:
    """What a consumer of sealed-frame version 1 sent, whatever this code would."""
    return DesktopOpen(channel=channel, framing=1 if channel else 0)


@pytest.mark.parametrize(
    ("consumer", "provider", "agreed"),
    [
        (FRAMING_VERSION, FRAMING_VERSION, FRAMING_VERSION),
        (1, FRAMING_VERSION, 0),  # a consumer of version 1: TLS records, never its binding
        (0, FRAMING_VERSION, 0),  # a consumer from before sealed frames
        (FRAMING_VERSION, 0, 0),  # a provider from before version 2
    ],
    ids=["both-sealed", "v1-consumer", "old-consumer", "old-provider"],
)
def test_framing_is_agreed_and_every_byte_arrives(
    nodes: tuple[Node, Node],
    monkeypatch: pytest.MonkeyPatch,
    consumer: int,
    provider: int,
    agreed: int,
) -> None:
    alice, bob = nodes
    offers: list[DesktopOpen] = []

    def offer(
        *, probe: bool = False, channel: bool = False, sealing: int = 0, framing: int = 0
    ) -> DesktopOpen:
        if probe:
            return DesktopOpen(probe=True)
        if consumer == 1:
            made = _as_version_1(channel, sealing)
        else:
            made = DesktopOpen(channel=channel, sealing=sealing)
        offers.append(made)
        return made

    monkeypatch.setattr(client_desktop, "FRAMING", consumer if consumer != 1 else 0)
    monkeypatch.setattr(client_desktop, "DesktopOpen", offer)
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
        if consumer != 1:
            # A provider of version 1 answers `framing` alone: 0 keeps it on TLS records.
            assert [(o.framing, o.sealing) for o in offers] == [(0, consumer)]

    arun(scenario())
