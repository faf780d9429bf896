"""The same-user check of the desktop tunnel and the CUDA bridge, attacked by another
local account over real loopback sockets.

A root consumer's tunnel or bridge once took a connection whose client had already
closed as root's: the kernel lists the orphaned socket with uid 0 and inode 0. Each
test makes the orphan deterministically: the other user's process connects, sends,
closes and exits before our side accepts (the kernel finishes the handshake in the
listen backlog; the test holds the event loop, or does not accept yet, meanwhile),
and the test waits until the kernel lists the client as that orphan: FIN_WAIT2,
uid 0, inode 0 (first the closed socket shows in FIN_WAIT1 with its own uid until
our side's delayed ACK).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpumesh.client.cudaremote import Bridge
from gpumesh.client.desktop import allow_desktop, share_desktop
from gpumesh.client.node import Node
from gpumesh.protocol.desktop import DesktopKind
from gpumesh.transport.sockowner import connection_owner, owner_check_available
from tests.conftest import OtherUser
from tests.integration.conftest import arun, pair_both, sharing
from tests.integration.test_desktop_tunnel import _tunnel, _wait_for

CEILING = 20.0
"""Generous bound for anything that should be quick (the CI box is loaded)."""

CONNECT_SEND_CLOSE = (
    "import socket, sys\n"
    "s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\n"
    "s.sendall(b'hello\\n')\n"
    "s.close()\n"
)
CONNECT_AND_HOLD = (
    "import socket, sys\n"
    "s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\n"
    "print('connected', flush=True)\n"
    "sys.stdin.read()\n"
)

pytestmark = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and owner_check_available()),
    reason="the same-user check reads Linux's /proc/net/tcp",
)


def _connect_send_close(other_user: OtherUser, port: int) -> None:
    """Another user's connect-send-close to ``port``; returns once the kernel lists the
    closed client as an orphan with uid 0 and inode 0."""
    ran = other_user.run(sys.executable, "-c", CONNECT_SEND_CLOSE, str(port))
    assert ran.returncode == 0, ran.stderr
    deadline = time.monotonic() + CEILING
    while not _orphan_connected_to(port):
        assert time.monotonic() < deadline, "the closed client never showed as an orphan"
        time.sleep(0.02)


def _orphan_connected_to(port: int) -> bool:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            # st 05 (FIN_WAIT2), uid 0, inode 0: as the kernel lists an orphan
            if fields[2].endswith(f":{port:04X}") and fields[3] == "05":
                return fields[7] == "0" and fields[9] == "0"
    return False


@pytest.fixture
def nodes(make_node: Callable[[str], Node]) -> tuple[Node, Node]:
    return make_node("alice-pc"), make_node("bob-laptop")


def test_an_orphaned_connection_of_another_user_proves_no_owner(other_user: OtherUser) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        _connect_send_close(other_user, port)  # gone before we accept
        orphan, _ = server.accept()
        with orphan:
            assert connection_owner(orphan) is None  # was 0, root's own uid
        # The same user's connection, still held, is told apart.
        holder = subprocess.Popen(
            other_user.argv(sys.executable, "-c", CONNECT_AND_HOLD, str(port)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline() == "connected\n"
            held, _ = server.accept()
            with held:
                assert connection_owner(held) == other_user.uid
        finally:
            holder.communicate("", timeout=CEILING)


def test_a_root_tunnel_refuses_another_users_connect_send_close(
    nodes: tuple[Node, Node], other_user: OtherUser
) -> None:
    alice, bob = nodes
    refused: list[int | None] = []
    reached: list[bytes] = []

    async def desktop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reached.append(await reader.read(100))
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(desktop, "127.0.0.1", 0)
        async with sharing(alice):
            pair_both(alice, bob)
            allow_desktop(alice, "bob-laptop")
            share_desktop(alice, DesktopKind.VNC, int(server.sockets[0].getsockname()[1]))
            async with _tunnel(bob, refused_local=refused.append) as (ready, _task):
                # Blocking here holds the tunnel's accept until the client is gone.
                _connect_send_close(other_user, ready.port)
                await _wait_for(lambda: bool(refused or reached))
                await asyncio.sleep(0.5)  # room for a wrongly carried hello to arrive
        server.close()

    arun(scenario())
    assert refused == [None]
    assert reached == []


def test_a_root_cuda_bridge_refuses_another_users_connect_send_close(
    nodes: tuple[Node, Node], other_user: OtherUser, caplog: pytest.LogCaptureFixture
) -> None:
    alice, bob = nodes
    caplog.set_level(logging.WARNING, logger="gpumesh.client.cudaremote")
    bridge = Bridge(bob, "alice-pc", "127.0.0.1:0")

    def refusals() -> list[str]:
        return [r.getMessage() for r in caplog.records if "serves only its own" in r.getMessage()]

    async def scenario() -> None:
        async with sharing(alice):
            pair_both(alice, bob)
            where = await bridge.start()
            try:
                # Blocking here holds the bridge's accept until the client is gone.
                _connect_send_close(other_user, int(where.rsplit(":", 1)[1]))
                await _wait_for(lambda: bool(refusals() or bridge.sessions))
            finally:
                bridge.close()

    arun(scenario())
    assert bridge.sessions == 0
    assert refusals() == [
        "the CUDA bridge serves only its own user's programs (this connection is of no "
        "provable owner); use --bind unix:PATH, a socket only you can open"
    ]


def test_a_root_cuda_bridge_refuses_every_one_of_30_tries(
    nodes: tuple[Node, Node], other_user: OtherUser, caplog: pytest.LogCaptureFixture
) -> None:
    """The race the attack ran (21 sessions in 100): the bridge accepts while the other
    user's connections come and go, so each is seen alive, closing or orphaned."""
    alice, bob = nodes
    caplog.set_level(logging.WARNING, logger="gpumesh.client.cudaremote")
    bridge = Bridge(bob, "alice-pc", "127.0.0.1:0")
    tries = 30

    def refused() -> int:
        return sum("serves only its own" in r.getMessage() for r in caplog.records)

    async def scenario() -> None:
        async with sharing(alice):
            pair_both(alice, bob)
            where = await bridge.start()
            try:
                loop = f"for _ in range({tries}):\n" + "".join(
                    "    " + line + "\n" for line in CONNECT_SEND_CLOSE.splitlines()[1:]
                )
                script = "import socket, sys\n" + loop
                attacker = await asyncio.create_subprocess_exec(
                    *other_user.argv(sys.executable, "-c", script, where.rsplit(":", 1)[1]),
                    stderr=asyncio.subprocess.PIPE,
                )
                _, err = await asyncio.wait_for(attacker.communicate(), CEILING)
                assert attacker.returncode == 0, err
                await _wait_for(lambda: refused() + bridge.sessions == tries)
            finally:
                bridge.close()

    arun(scenario())
    assert (bridge.sessions, refused()) == (0, tries)
