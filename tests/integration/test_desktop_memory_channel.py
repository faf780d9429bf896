"""A desktop connection's data channel opened with its TLS on memory buffers
(``dial_memory`` and ``Listener.accept_memory``), on real loopback sockets: the
same admission as ``cp``'s channel (only the ticket gets in; a connection without
TLS, with a wrong ticket or silent is closed and the wait goes on), the same key
pin, and bytes that cross between the memory-buffer end and Python's TLS socket."""

from __future__ import annotations

import secrets
import socket
import ssl
import threading

import pytest

from gpumesh.errors import AccessDeniedError, KeyMismatchError
from gpumesh.identity.keys import Identity
from gpumesh.transport.channel import (
    TICKET_BYTES,
    Listener,
    MemoryChannel,
    dial,
    dial_memory,
    server_context,
)

CEILING = 30.0


def _accepting(listener: Listener, wait: float) -> tuple[threading.Thread, list[object]]:
    """accept_memory on a thread; its channel or its error lands in the list."""
    result: list[object] = []

    def accept() -> None:
        try:
            result.append(listener.accept_memory(wait))
        except Exception as exc:
            result.append(exc)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    return thread, result


def _send(channel: MemoryChannel, data: bytes) -> None:
    channel.tls.write(data)
    channel.sock.sendall(channel.outgoing.read())


def _receive(channel: MemoryChannel, count: int) -> bytes:
    got = b""
    while len(got) < count:
        try:
            got += channel.tls.read(count - len(got))
        except ssl.SSLWantReadError:
            data = channel.sock.recv(65536)
            assert data, "the channel closed early"
            channel.incoming.write(data)
    return got


def test_only_the_ticket_gets_in_and_bytes_cross_both_ways() -> None:
    identity = Identity.generate()
    ticket = secrets.token_bytes(TICKET_BYTES)
    listener = Listener("127.0.0.1", server_context(identity), ticket, peer="127.0.0.1")
    thread, result = _accepting(listener, CEILING)
    no_tls = socket.create_connection(("127.0.0.1", listener.port), timeout=CEILING)
    silent = socket.create_connection(("127.0.0.1", listener.port), timeout=CEILING)
    wrong = dial_memory("127.0.0.1", listener.port, identity.public_key, bytes(TICKET_BYTES))
    try:
        no_tls.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert no_tls.recv(1) == b""  # its handshake failed: closed
        wrong.sock.settimeout(CEILING)
        assert wrong.sock.recv(1) == b""  # a wrong ticket: closed unanswered
        assert thread.is_alive()  # neither ended the wait
        # The right one, as a node of the previous release dials it (Python's TLS socket).
        right = dial("127.0.0.1", listener.port, identity.public_key, ticket, CEILING)
        thread.join(CEILING)
        (accepted,) = result
        assert isinstance(accepted, MemoryChannel)
        try:
            right.sock.sendall(b"ping")
            assert _receive(accepted, 4) == b"ping"
            _send(accepted, b"pong" * 10000)
            got = b""
            while len(got) < 40000:
                got += right.sock.recv(65536)
            assert got == b"pong" * 10000
        finally:
            accepted.close()
            right.close()
        silent.settimeout(CEILING)
        assert silent.recv(1) == b""  # still in its handshake when the listener returned
    finally:
        for sock in (no_tls, silent):
            sock.close()
        wrong.close()
        listener.close()


def test_a_wrong_ticket_alone_is_refused_once_the_wait_ends() -> None:
    identity = Identity.generate()
    listener = Listener(
        "127.0.0.1", server_context(identity), secrets.token_bytes(32), peer="127.0.0.1"
    )
    thread, result = _accepting(listener, 1.0)
    wrong = dial_memory("127.0.0.1", listener.port, identity.public_key, bytes(TICKET_BYTES))
    try:
        thread.join(CEILING)
        (error,) = result
        assert isinstance(error, AccessDeniedError)
        assert "wrong ticket" in str(error)
    finally:
        wrong.close()


def test_another_key_is_not_dialled() -> None:
    listener = Listener(
        "127.0.0.1", server_context(Identity.generate()), bytes(32), peer="127.0.0.1"
    )
    thread, _result = _accepting(listener, 2.0)
    try:
        with pytest.raises(KeyMismatchError, match="different key"):
            dial_memory("127.0.0.1", listener.port, Identity.generate().public_key, bytes(32))
    finally:
        listener.stop()
        thread.join(CEILING)
