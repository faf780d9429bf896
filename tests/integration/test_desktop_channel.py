"""Desktop connections over a data channel (TLS on TCP) beside their QUIC stream.

Real nodes on loopback, a plain TCP server of the test's own as the desktop.
Which path carried a connection is read from what the tunnel reports for it
and from the owner's view, never from timing. The test that blocks the
channel's TCP port uses iptables on a loopback address of its own (as
test_bulk_channel.py does); it needs root.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import AsyncIterator, Callable

import pytest

from gpumesh.agent.server import Agent
from gpumesh.client.desktop import allow_desktop, deny_desktop, share_desktop
from gpumesh.client.node import Node
from gpumesh.errors import AccessDeniedError, GPUMeshError
from gpumesh.protocol.desktop import DesktopKind
from tests.integration.conftest import arun, pair_both, sharing
from tests.integration.test_bulk_channel import _firewalled
from tests.integration.test_desktop_tunnel import (
    CEILING,
    _echo,
    _hash_then_reply,
    _serve_desktop,
    _tunnel,
    _wait_for,
)


@pytest.fixture
def nodes(make_node: Callable[[str], Node]) -> tuple[Node, Node]:
    return make_node("alice-pc"), make_node("bob-laptop")


@contextlib.asynccontextmanager
async def _serving(alice: Node, bob: Node, host: str) -> AsyncIterator[Agent]:
    """alice's agent on ``host`` (an ephemeral port), and bob pointed at it."""
    agent = Agent(alice.home, host=host, port=0)
    await agent.start()
    try:
        peer = bob.peer("alice-pc")
        bob.home.store.touch_peer(peer.node_id, address=f"{host}:{agent.address[1]}")
        yield agent
    finally:
        agent.stop()


def _allowed(alice: Node, bob: Node) -> None:
    pair_both(alice, bob)
    allow_desktop(alice, "bob-laptop")


async def _send_all(port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    await writer.drain()
    writer.write_eof()  # half-close: the server answers only after our EOF
    answer = await reader.read()
    writer.close()
    return answer


def test_on_a_direct_link_connections_take_a_data_channel(nodes: tuple[Node, Node]) -> None:
    alice, bob = nodes
    payload = os.urandom(12 * 1024 * 1024 + 3)
    paths: list[str] = []

    async def scenario() -> None:
        server, port = await _serve_desktop(_hash_then_reply)
        async with sharing(alice) as agent:
            _allowed(alice, bob)
            share_desktop(alice, DesktopKind.RDP, port)
            async with _tunnel(bob, carried=paths.append) as (ready, _task):
                answers = await asyncio.wait_for(
                    asyncio.gather(*(_send_all(ready.port, payload) for _ in range(2))),
                    CEILING * 3,
                )
                expected = f"{len(payload)} {hashlib.sha256(payload).hexdigest()}\n".encode()
                assert answers == [expected] * 2  # every byte, and the half-close
                # An open one, as the owner sees it.
                _reader, writer = await asyncio.open_connection("127.0.0.1", ready.port)
                await _wait_for(lambda: len(agent.desktop.sessions()) == 1)
                assert [s.path for s in agent.desktop.sessions()] == ["channel"]
                await _wait_for(lambda: _published_paths(alice) == ["channel"])
                # The owner counts the session once it offers the channel; the
                # tunnel reports the path once its own dial is through.
                await _wait_for(lambda: len(paths) == 3)
                writer.close()
        server.close()
        assert paths == ["channel"] * 3

    arun(scenario())


def _published_paths(alice: Node) -> list[str]:
    info = alice.home.agent_info()
    return [entry.get("path", "") for entry in info.desktop] if info else []


def test_with_data_channels_off_connections_go_over_quic(nodes: tuple[Node, Node]) -> None:
    alice, bob = nodes
    alice.home.config.set("data_channel", "off")
    alice.home.config.save()
    paths: list[str] = []

    async def scenario() -> None:
        server, port = await _serve_desktop(_echo)
        async with sharing(alice) as agent:
            _allowed(alice, bob)
            share_desktop(alice, DesktopKind.VNC, port)
            async with _tunnel(bob, carried=paths.append) as (ready, _task):
                reader, writer = await asyncio.open_connection("127.0.0.1", ready.port)
                writer.write(b"over quic\n")
                assert await asyncio.wait_for(reader.readline(), CEILING) == b"over quic\n"
                assert [s.path for s in agent.desktop.sessions()] == ["quic"]
                writer.close()
        server.close()
        assert paths == ["quic"]

    arun(scenario())


@pytest.mark.parametrize("how", ["desktop deny", "gpumesh deny"])
def test_a_deny_cuts_a_connection_on_a_data_channel(nodes: tuple[Node, Node], how: str) -> None:
    alice, bob = nodes
    paths: list[str] = []

    async def scenario() -> GPUMeshError:
        server, port = await _serve_desktop(_echo)
        async with sharing(alice) as agent:
            _allowed(alice, bob)
            share_desktop(alice, DesktopKind.VNC, port)
            async with _tunnel(bob, carried=paths.append) as (ready, task):
                reader, writer = await asyncio.open_connection("127.0.0.1", ready.port)
                writer.write(b"hello\n")
                assert await asyncio.wait_for(reader.readline(), CEILING) == b"hello\n"
                assert paths == ["channel"]
                if how == "desktop deny":
                    deny_desktop(alice, "bob-laptop")
                else:
                    alice.deny("bob-laptop")
                # The connection ends (EOF) and the tunnel with the reason, with no
                # further traffic from the client.
                assert await asyncio.wait_for(reader.read(), CEILING) == b""
                with pytest.raises(GPUMeshError) as ended:
                    await asyncio.wait_for(task, CEILING)
                writer.close()
            await _wait_for(lambda: not agent.desktop.sessions())
        server.close()
        return ended.value

    ended = arun(scenario())
    assert isinstance(ended, AccessDeniedError)
    assert "revoked your access" in ended.message


def test_a_blocked_channel_falls_back_to_quic_and_is_remembered(nodes: tuple[Node, Node]) -> None:
    """A firewall resets the channel's TCP connection: the first desktop connection
    declines the channel and goes over QUIC; the next does not try it."""
    alice, bob = nodes
    paths: list[str] = []

    async def scenario(host: str) -> None:
        server, port = await _serve_desktop(_echo)
        async with _serving(alice, bob, host) as agent:
            share_desktop(alice, DesktopKind.VNC, port)
            async with _tunnel(bob, carried=paths.append) as (ready, _task):
                for line in (b"first\n", b"second\n"):
                    reader, writer = await asyncio.open_connection("127.0.0.1", ready.port)
                    writer.write(line)
                    assert await asyncio.wait_for(reader.readline(), CEILING) == line
                    assert [s.path for s in agent.desktop.sessions()] == ["quic"]
                    writer.close()
                    await _wait_for(lambda: not agent.desktop.sessions())
        server.close()

    _allowed(alice, bob)
    with _firewalled(["REJECT", "--reject-with", "tcp-reset"]) as (host, block):
        alice.home.config.set("listen_host", host)
        alice.home.config.save()
        block()
        arun(scenario(host))
    assert paths == ["quic", "quic"]
    assert bob.peer("alice-pc").channel_blocked_until > 0
