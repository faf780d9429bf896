"""The desktop tunnel's data channel listener, attacked on real loopback sockets:
another address is closed before TLS, a wrong ticket is closed before a byte is
carried, and once the peer's one connection is taken nothing else gets in."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl

import pytest

from gpumesh.errors import AccessDeniedError, UnreachableError
from gpumesh.files.channel import (
    TICKET_BYTES,
    StreamsListener,
    client_context,
    dial_streams,
    server_context,
)
from gpumesh.identity.keys import Identity

TICKET = bytes(range(TICKET_BYTES))
LIMIT = 1 << 16


def closed_unread(sock: socket.socket) -> bool:
    sock.settimeout(10)  # a timeout (still open) is an error, not a close
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, ssl.SSLError):
        return True


async def _close(*writers: asyncio.StreamWriter) -> None:
    for writer in writers:
        writer.close()
        with contextlib.suppress(OSError, ConnectionError):
            await writer.wait_closed()
    await asyncio.sleep(0.2)  # the listener's own closes of what it refused


async def _eof(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), 10) == b""
    except (ConnectionResetError, ssl.SSLError):  # a timeout (still open) is an error
        return True


def test_strangers_and_wrong_tickets_get_nothing_and_the_peer_gets_in_once() -> None:
    identity = Identity.generate()

    async def scenario() -> None:
        listener = StreamsListener(server_context(identity), TICKET, peer="127.0.0.1", limit=LIMIT)
        await listener.start("127.0.0.1")
        loop = asyncio.get_running_loop()

        def stranger() -> bool:
            """TLS and the right ticket, from another address: closed before TLS."""
            with socket.create_connection(
                ("127.0.0.1", listener.port), timeout=10, source_address=("127.0.0.2", 0)
            ) as sock:
                try:
                    tls = client_context().wrap_socket(sock)
                except (ssl.SSLError, ConnectionError):
                    return True
                with tls:
                    tls.sendall(TICKET)
                    return closed_unread(tls)

        assert await loop.run_in_executor(None, stranger)
        reader, writer = await dial_streams(
            "127.0.0.1", listener.port, identity.public_key, bytes(TICKET_BYTES), limit=LIMIT
        )
        writer.write(b"x" * 1000)
        assert await _eof(reader)  # a wrong ticket: closed, nothing carried
        await _close(writer)

        accepting = asyncio.ensure_future(listener.accept(wait=30))
        reader, writer = await dial_streams(
            "127.0.0.1", listener.port, identity.public_key, TICKET, limit=LIMIT
        )
        far_reader, far_writer = await accepting
        writer.write(b"hello")
        assert await far_reader.readexactly(5) == b"hello"
        with pytest.raises(UnreachableError):  # the listener is closed once its one is taken
            await dial_streams("127.0.0.1", listener.port, identity.public_key, TICKET, limit=LIMIT)
        await _close(writer, far_writer)

    asyncio.run(scenario())


def test_only_wrong_tickets_end_in_a_refusal_that_says_so() -> None:
    identity = Identity.generate()

    async def scenario() -> None:
        listener = StreamsListener(server_context(identity), TICKET, peer="127.0.0.1", limit=LIMIT)
        await listener.start("127.0.0.1")
        accepting = asyncio.ensure_future(listener.accept(wait=3))
        reader, writer = await dial_streams(
            "127.0.0.1", listener.port, identity.public_key, b"\xff" * TICKET_BYTES, limit=LIMIT
        )
        assert await _eof(reader)
        await _close(writer)
        with pytest.raises(AccessDeniedError, match="opened with a wrong ticket"):
            await accepting

    asyncio.run(scenario())
