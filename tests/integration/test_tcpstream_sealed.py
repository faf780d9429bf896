"""Sealed frames on a real data channel: two splices back to back (``tcpstream._Splice``).

A real TLS 1.3 channel on loopback (the node's certificate, the ticket), the
dialler's splice on one end and the acceptor's on the other, each with a real
local TCP connection to a program (the test). The two switch the channel to
sealed frames after TLS, as a desktop connection's ends do when they agreed on
it. For the refusals, a TCP relay of the test's own sits in the channel's path
and changes or cuts its bytes once the switch is done.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from gpumesh.identity.keys import Identity
from gpumesh.protocol.handshake import BINDING_SIZE
from gpumesh.transport.channel import (
    TICKET_BYTES,
    Listener,
    MemoryChannel,
    dial_memory,
    server_context,
)
from gpumesh.transport.sealing import MAX_PLAIN
from gpumesh.transport.tcpstream import _ChannelError, _Splice
from tests.integration.test_tcpstream_splice import (
    CEILING,
    Moving,
    _read_exactly,
    _tcp_pair,
    _until_eof,
)


class _Relay:
    """A TCP relay between the dialler and the listener: after ``after`` bytes from
    the acceptor's side toward the dialler, ``spoil`` changes what passes (or
    returns None: the relay cuts both connections there)."""

    def __init__(self, target: int, after: int, spoil: Callable[[bytes], bytes | None]) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._server.getsockname()[1]
        self._target, self._after, self._spoil = target, after, spoil
        self._socks: list[socket.socket] = [self._server]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        with contextlib.suppress(OSError):
            dialler, _ = self._server.accept()
            self._socks.append(dialler)
            acceptor = socket.create_connection(("127.0.0.1", self._target))
            self._socks.append(acceptor)
            threading.Thread(target=self._copy, args=(dialler, acceptor, None), daemon=True).start()
            self._copy(acceptor, dialler, self._after)

    def _copy(self, src: socket.socket, dst: socket.socket, after: int | None) -> None:
        passed = 0
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if after is not None and passed + len(data) > after:
                    keep = max(after - passed, 0)
                    spoiled = self._spoil(data[keep:])
                    if spoiled is None:
                        dst.sendall(data[:keep])
                        self.close()
                        return
                    data = data[:keep] + spoiled
                    after = None
                passed += len(data)
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def _channels(relay: Callable[[int], int] | None = None) -> tuple[MemoryChannel, MemoryChannel]:
    """A data channel on loopback, both ends on memory buffers: (dialler's, acceptor's).
    ``relay`` turns the listener's port into the one the dialler connects to."""
    identity = Identity.generate()
    ticket = secrets.token_bytes(TICKET_BYTES)
    listener = Listener("127.0.0.1", server_context(identity), ticket, peer="127.0.0.1")
    result: list[MemoryChannel] = []
    thread = threading.Thread(target=lambda: result.append(listener.accept_memory(CEILING)))
    thread.start()
    port = listener.port if relay is None else relay(listener.port)
    near = dial_memory("127.0.0.1", port, identity.public_key, ticket)
    thread.join(CEILING)
    return near, result[0]


class Tunnel:
    """Both splices running: the dialler's program and the acceptor's program.
    ``bindings``: the QUIC session binding each end seals to (dialler's, acceptor's;
    by default one fresh binding for both, as two ends of one session have)."""

    def __init__(
        self,
        relay: Callable[[int], int] | None = None,
        bindings: tuple[bytes, bytes] | None = None,
    ) -> None:
        near, far = _channels(relay)
        ours, self.consumer = _tcp_pair()
        theirs, self.server = _tcp_pair()
        if bindings is None:
            shared = os.urandom(BINDING_SIZE)
            bindings = (shared, shared)
        self.dialler = Moving(_Splice(ours, near, sealed_to=bindings[0], dialler=True))
        self.acceptor = Moving(_Splice(theirs, far, sealed_to=bindings[1]))
        for sock in (self.consumer, self.server):
            sock.settimeout(CEILING)
        self.relays: list[_Relay] = []

    def close(self) -> None:
        for relay in self.relays:
            relay.close()
        for moving in (self.dialler, self.acceptor):
            moving.splice.stop()
            moving.thread.join(CEILING)
        for sock in (self.consumer, self.server):
            sock.close()


@pytest.fixture
def tunnel() -> Iterator[Tunnel]:
    made = Tunnel()
    try:
        yield made
    finally:
        made.close()


def test_both_ways_with_half_close_then_both_end_cleanly(tunnel: Tunnel) -> None:
    up, down = os.urandom(9 * MAX_PLAIN + 7), os.urandom(5 * MAX_PLAIN + 11)

    def send() -> None:
        tunnel.consumer.sendall(up)
        tunnel.consumer.shutdown(socket.SHUT_WR)

    sender = threading.Thread(target=send)
    sender.start()
    assert _until_eof(tunnel.server) == up  # the consumer's EOF is the server's
    # The server still answers after the consumer's half-close.
    tunnel.server.sendall(down)
    tunnel.server.shutdown(socket.SHUT_WR)
    assert _until_eof(tunnel.consumer) == down
    sender.join(CEILING)
    assert tunnel.dialler.ended() is None
    assert tunnel.acceptor.ended() is None


def test_the_server_may_speak_first(tunnel: Tunnel) -> None:
    """What the acceptor sends right after its random (a VNC server's greeting)
    reaches the dialler, even when it came in the same read as that random."""
    tunnel.server.sendall(b"RFB 003.008\n")
    assert _read_exactly(tunnel.consumer.recv, 12) == b"RFB 003.008\n"
    tunnel.consumer.sendall(b"RFB 003.008\n")
    assert _read_exactly(tunnel.server.recv, 12) == b"RFB 003.008\n"


def test_small_messages_go_back_and_forth_one_at_a_time(tunnel: Tunnel) -> None:
    for index in range(300):
        request = os.urandom(1 + index % 64)
        tunnel.consumer.sendall(request)
        assert _read_exactly(tunnel.server.recv, len(request)) == request
        tunnel.server.sendall(request[::-1])
        assert _read_exactly(tunnel.consumer.recv, len(request)) == request[::-1]


def _relayed(after: int, spoil: Callable[[bytes], bytes | None]) -> Tunnel:
    relays: list[_Relay] = []

    def relay(port: int) -> int:
        relays.append(_Relay(port, after, spoil))
        return relays[0].port

    made = Tunnel(relay)
    made.relays = relays
    return made


# Past the acceptor's handshake records, session tickets and random: its first frame.
_PAST_TLS = 8192


_REFUSED = ("authentication", "a frame of", "ended in the middle")
"""A changed byte in a frame's body fails its tag; in its length, makes it too large,
or swallows the next frames' bytes (which then fail the tag or never all come)."""


@pytest.mark.parametrize("where", [0, 1, 2, 3, 5, 40, 70_000])
def test_a_changed_byte_ends_the_connection(where: int) -> None:
    made = _relayed(_PAST_TLS + where, lambda data: bytes([data[0] ^ 0x40]) + data[1:])
    try:
        _refused_after(made, _REFUSED)
    finally:
        made.close()


def test_a_cut_channel_ends_the_connection() -> None:
    made = _relayed(_PAST_TLS + 1000, lambda data: None)
    try:
        _refused_after(made, ("ended in the middle",))
    finally:
        made.close()


def test_ends_sealed_to_different_quic_sessions_open_no_frame() -> None:
    """The keys are bound to the QUIC session whose request agreed on the switch:
    a channel whose two ends came from two sessions (one end's request relayed by
    someone who holds neither session's secrets) opens no frame, although the
    randoms crossed the channel's TLS unchanged. Nothing reaches the program."""
    made = Tunnel(bindings=(os.urandom(BINDING_SIZE), os.urandom(BINDING_SIZE)))
    try:
        made.consumer.settimeout(CEILING)
        _refused_after(made, ("authentication",))
        with contextlib.suppress(ConnectionResetError):  # the splice ended: no byte
            assert made.consumer.recv(1) == b""
    finally:
        made.close()


def _refused_after(made: Tunnel, why: tuple[str, ...]) -> None:
    """The server sends past the relay's mark and half-closes: the dialler's splice
    ends with a channel error, and what reached the consumer is genuine."""
    payload = os.urandom(_PAST_TLS + 300_000)

    def send() -> None:
        with contextlib.suppress(OSError):
            made.server.sendall(payload)
            made.server.shutdown(socket.SHUT_WR)

    threading.Thread(target=send, daemon=True).start()
    error = made.dialler.ended()
    assert isinstance(error, _ChannelError)
    assert any(reason in str(error) for reason in why), str(error)
    received = _until_eof(made.consumer)
    assert len(received) < len(payload)
    assert payload.startswith(received)
