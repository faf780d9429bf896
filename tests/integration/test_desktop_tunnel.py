"""The desktop tunnel's plumbing over real QUIC and real TCP on loopback.

The "desktop server" here is a plain TCP server of the test's own (echo, hash,
byte counter), so each property (back-pressure, half-close, several
connections, refusals, revocation, the loopback-only listener, the same-user
check) is asserted on bytes; test_desktop_vnc.py and test_desktop_rdp.py run
real VNC and RDP servers and clients through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from gpumesh.client.desktop import (
    TunnelReady,
    allow_desktop,
    deny_desktop,
    desktop_tunnel,
    parse_bind,
    share_desktop,
    stop_desktop_share,
)
from gpumesh.client.node import Node
from gpumesh.errors import (
    AccessDeniedError,
    AgentError,
    BadRequestError,
    GPUMeshError,
    NotFoundError,
)
from gpumesh.protocol.desktop import DesktopKind
from gpumesh.transport.sockowner import owner_check_available
from tests.integration.conftest import arun, pair_both, sharing

CEILING = 20.0
"""Generous bound for anything that should be quick (the CI box is loaded)."""


async def _serve_desktop(
    handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], object],
) -> tuple[asyncio.Server, int]:
    async def wrapped(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)  # type: ignore[misc]
        except ConnectionError:
            pass  # e.g. the probe of `desktop connect`: connects, then closes
        finally:
            writer.close()

    server = await asyncio.start_server(wrapped, "127.0.0.1", 0)
    return server, int(server.sockets[0].getsockname()[1])


async def _hash_then_reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Reads to EOF (the client's half-close), then answers the digest and its size."""
    digest = hashlib.sha256()
    size = 0
    while chunk := await reader.read(1 << 16):
        digest.update(chunk)
        size += len(chunk)
    writer.write(f"{size} {digest.hexdigest()}\n".encode())
    await writer.drain()


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while line := await reader.readline():
        writer.write(line)
        await writer.drain()


@contextlib.asynccontextmanager
async def _tunnel(
    bob: Node, peer: str = "alice-pc", **kwargs: object
) -> AsyncIterator[tuple[TunnelReady, asyncio.Task[None]]]:
    ready: asyncio.Future[TunnelReady] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        desktop_tunnel(bob, peer, bind=("127.0.0.1", 0), ready=ready.set_result, **kwargs)  # type: ignore[arg-type]
    )
    done, _ = await asyncio.wait({task, ready}, timeout=CEILING, return_when="FIRST_COMPLETED")
    if task in done:
        task.result()  # raises the refusal
    assert ready in done
    try:
        yield ready.result(), task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, GPUMeshError):
            await task


@pytest.fixture
def nodes(make_node: Callable[[str], Node]) -> tuple[Node, Node]:
    return make_node("alice-pc"), make_node("bob-laptop")


def test_refused_when_not_on_the_desktop_allowlist(nodes: tuple[Node, Node]) -> None:
    alice, bob = nodes

    async def scenario() -> None:
        server, port = await _serve_desktop(_echo)
        async with sharing(alice):
            pair_both(alice, bob)  # allowed for jobs: the desktop has its own list
            share_desktop(alice, DesktopKind.VNC, port)
            with pytest.raises(AccessDeniedError) as denied:
                async with _tunnel(bob):
                    pass
        server.close()
        assert "has not allowed you to use its desktop" in denied.value.message
        assert "gpumesh desktop allow" in denied.value.message

    arun(scenario())


def test_refused_when_not_shared_or_no_server(nodes: tuple[Node, Node]) -> None:
    alice, bob = nodes

    async def scenario() -> None:
        async with sharing(alice):
            pair_both(alice, bob)
            allow_desktop(alice, "bob-laptop")
            with pytest.raises(NotFoundError) as unshared:
                async with _tunnel(bob):
                    pass
            assert "does not share its desktop" in unshared.value.message
            server, port = await _serve_desktop(_echo)
            server.close()
            await server.wait_closed()  # the port is free: nothing listens there
            share_desktop(alice, DesktopKind.RDP, port)
            with pytest.raises(AgentError) as no_server:
                async with _tunnel(bob):
                    pass
            assert f"on port {port}, but no server answers there" in no_server.value.message

    arun(scenario())


def test_connections_carry_bytes_with_half_close_and_back_pressure(
    nodes: tuple[Node, Node],
) -> None:
    alice, bob = nodes
    payload = os.urandom(24 * 1024 * 1024)

    async def send_all(port: int) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(payload)
        await writer.drain()
        writer.write_eof()  # half-close: the server answers only after our EOF
        answer = await reader.read()
        writer.close()
        return answer

    async def scenario() -> None:
        server, port = await _serve_desktop(_hash_then_reply)
        async with sharing(alice):
            pair_both(alice, bob)
            allow_desktop(alice, "bob-laptop")
            share_desktop(alice, DesktopKind.RDP, port)
            async with _tunnel(bob) as (ready, _task):
                assert ready.offer.kind is DesktopKind.RDP
                assert ready.offer.port == port
                assert ready.host == "127.0.0.1"
                # Several connections at once, each on its own stream (RDP opens more than one).
                answers = await asyncio.wait_for(
                    asyncio.gather(*(send_all(ready.port) for _ in range(3))), CEILING * 3
                )
                expected = f"{len(payload)} {hashlib.sha256(payload).hexdigest()}\n".encode()
                assert answers == [expected] * 3
        server.close()

    arun(scenario())


_FLOODED: list[int] = []


async def _flood(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Writes 1 MiB blocks for as long as it is let: counts what was taken."""
    _FLOODED.append(0)
    block = b"x" * (1 << 20)
    for _ in range(512):
        writer.write(block)
        await writer.drain()
        _FLOODED[-1] += len(block)


def test_a_client_that_does_not_read_holds_the_server_back(nodes: tuple[Node, Node]) -> None:
    alice, bob = nodes

    async def scenario() -> None:
        server, port = await _serve_desktop(_flood)
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            allow_desktop(alice, "bob-laptop")
            share_desktop(alice, DesktopKind.VNC, port)
            async with _tunnel(bob) as (ready, _task):
                reader, writer = await asyncio.open_connection("127.0.0.1", ready.port)
                before = await _plateau()
                # The server is stuck: what it could write is bounded by buffers (its
                # socket's, the stream's credit, the client's socket's), far below
                # the 512 MiB it tried.
                assert 0 < before < 64 * 1024 * 1024
                assert len(agent.desktop.sessions()) == 1
                got = 0
                while got < before + (1 << 20):  # reading lets it go on
                    chunk = await asyncio.wait_for(reader.read(1 << 20), CEILING)
                    assert chunk
                    got += len(chunk)
                writer.close()
        server.close()

    _FLOODED.clear()
    arun(scenario())


async def _plateau() -> int:
    """What the flood server wrote once it stopped getting further (its writes block)."""
    last = -1
    async with asyncio.timeout(CEILING * 3):
        while True:
            await asyncio.sleep(0.3)
            now = _FLOODED[-1] if _FLOODED else 0
            if now == last and now > 0:
                return now
            last = now


async def _wait_for(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(CEILING):
        while True:  # the agent's books change between two loop turns: polled
            if check():
                return
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("how", ["desktop deny", "gpumesh deny", "share stop"])
def test_revocation_cuts_an_open_session(nodes: tuple[Node, Node], how: str) -> None:
    alice, bob = nodes

    async def scenario() -> None:
        server, port = await _serve_desktop(_echo)
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            allow_desktop(alice, "bob-laptop")
            share_desktop(alice, DesktopKind.VNC, port)
            async with _tunnel(bob) as (ready, task):
                reader, writer = await asyncio.open_connection("127.0.0.1", ready.port)
                writer.write(b"hello\n")
                assert await asyncio.wait_for(reader.readline(), CEILING) == b"hello\n"
                # The owner sees who is connected.
                info = alice.home.agent_info()
                assert info is not None and [d["peer"] for d in info.desktop] == ["bob-laptop"]
                if how == "desktop deny":
                    deny_desktop(alice, "bob-laptop")
                elif how == "gpumesh deny":
                    alice.deny("bob-laptop")
                else:
                    stop_desktop_share(alice)
                # The open connection ends (EOF) and the tunnel ends with the reason,
                # without any further traffic from the client.
                assert await asyncio.wait_for(reader.read(), CEILING) == b""
                with pytest.raises(GPUMeshError) as ended:
                    await asyncio.wait_for(task, CEILING)
                writer.close()
            await _wait_for(lambda: not agent.desktop.sessions())
        server.close()
        if how == "share stop":
            assert isinstance(ended.value, NotFoundError)
            assert "stopped sharing its desktop" in ended.value.message
        else:
            assert isinstance(ended.value, AccessDeniedError)
            assert "revoked your access" in ended.value.message

    arun(scenario())


def test_the_probe_does_not_connect_to_the_desktop_server(nodes: tuple[Node, Node]) -> None:
    """A VNC server started for one client (x11vnc without -forever) exits when that
    client leaves: `connect`'s first check must not be that client."""
    alice, bob = nodes
    accepted: list[int] = []

    async def count(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        await _echo(reader, writer)

    async def scenario() -> None:
        server, port = await _serve_desktop(count)
        async with sharing(alice):
            pair_both(alice, bob)
            allow_desktop(alice, "bob-laptop")
            share_desktop(alice, DesktopKind.VNC, port)
            async with _tunnel(bob) as (ready, _task):
                assert accepted == []
                reader, writer = await asyncio.open_connection("127.0.0.1", ready.port)
                writer.write(b"one\n")
                assert await asyncio.wait_for(reader.readline(), CEILING) == b"one\n"
                assert accepted == [1]
                writer.close()
        server.close()

    if owner_check_available():
        arun(scenario())


def test_a_connection_over_the_providers_limit_is_refused_and_the_tunnel_goes_on(
    nodes: tuple[Node, Node],
) -> None:
    alice, bob = nodes
    alice.home.config.set("max_requests_per_link", "2")
    alice.home.config.save()
    refused: list[GPUMeshError] = []

    async def echo_once(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"hi\n")
        assert await asyncio.wait_for(reader.readline(), CEILING) == b"hi\n"
        return reader, writer

    async def scenario() -> None:
        server, port = await _serve_desktop(_echo)
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            allow_desktop(alice, "bob-laptop")
            share_desktop(alice, DesktopKind.RDP, port)
            async with _tunnel(bob, connection_refused=refused.append) as (ready, task):
                held = [await echo_once(ready.port) for _ in range(2)]
                reader, writer = await asyncio.open_connection("127.0.0.1", ready.port)
                assert await asyncio.wait_for(reader.read(), CEILING) == b""  # refused
                writer.close()
                assert len(refused) == 1
                assert "max_requests_per_link is 2" in refused[0].message
                held[0][1].close()  # one ends: room for the next
                await _wait_for(lambda: len(agent.desktop.sessions()) == 1)
                held[0] = await echo_once(ready.port)
                assert not task.done() and len(refused) == 1
                for _reader, held_writer in held:
                    held_writer.close()
        server.close()

    arun(scenario())


def test_listener_binds_loopback_only(nodes: tuple[Node, Node]) -> None:
    alice, bob = nodes
    for text in ("0.0.0.0:15900", "192.168.1.5", "[::]:1", "example.com:5"):
        with pytest.raises(BadRequestError) as bad:
            parse_bind(text)
        assert "loopback address only" in bad.value.message
    assert parse_bind("13389") == ("127.0.0.1", 13389)
    assert parse_bind("127.0.0.2:0") == ("127.0.0.2", 0)
    assert parse_bind("[::1]:15901") == ("::1", 15901)

    async def scenario() -> None:
        server, port = await _serve_desktop(_echo)
        async with sharing(alice):
            pair_both(alice, bob)
            allow_desktop(alice, "bob-laptop")
            share_desktop(alice, DesktopKind.VNC, port)
            async with _tunnel(bob) as (ready, _task):
                listening = _tcp_listeners(ready.port)
                assert listening == {"127.0.0.1"}
        server.close()

    if sys.platform.startswith("linux"):
        arun(scenario())


def _tcp_listeners(port: int) -> set[str]:
    """Addresses with a listening TCP socket on ``port``, from the kernel's table."""
    from gpumesh.transport.sockowner import _address

    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                host, local_port = _address(fields[1])
                if local_port == port and fields[3] == "0A":  # TCP_LISTEN
                    found.add(host)
    return found


def test_another_users_connection_is_refused(nodes: tuple[Node, Node]) -> None:
    if not (owner_check_available() and os.getuid() == 0 and shutil.which("setpriv")):
        # CI runs the tests as root on Linux (its setup scripts install packages).
        if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
            pytest.fail("CI must run this as root on Linux with setpriv (util-linux)")
        pytest.skip("needs Linux, root and setpriv, to connect as another user (nobody)")
    alice, bob = nodes
    refused: list[int | None] = []
    client = (
        "import socket, sys\n"
        "s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\n"
        "try:\n"
        "    s.sendall(b'hello\\n'); print(repr(s.recv(100)))\n"
        "except ConnectionResetError:\n"
        "    print('reset')\n"
    )

    async def as_user(user: str, port: int) -> str:
        command = [sys.executable, "-c", client, str(port)]
        if user != "root":
            command = ["setpriv", f"--reuid={user}", "--regid=65534", "--clear-groups", *command]
        proc = await asyncio.create_subprocess_exec(
            *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await asyncio.wait_for(proc.communicate(), CEILING)
        assert proc.returncode == 0, err
        return out.decode().strip()

    async def scenario() -> None:
        server, port = await _serve_desktop(_echo)
        async with sharing(alice):
            pair_both(alice, bob)
            allow_desktop(alice, "bob-laptop")
            share_desktop(alice, DesktopKind.VNC, port)
            async with _tunnel(bob, refused_local=refused.append) as (ready, _task):
                assert ready.owner_checked
                assert await as_user("root", ready.port) == "b'hello\\n'"
                # Closed unanswered (reset when the hello was still unread).
                assert await as_user("nobody", ready.port) in ("b''", "reset")
        server.close()

    arun(scenario())
    nobody = int(Path("/etc/passwd").read_text().split("\nnobody:")[1].split(":")[1])
    assert refused == [nobody]
