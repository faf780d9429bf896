"""The byte mover of a desktop connection on a data channel (``tcpstream._Splice``),
on real sockets: a real TLS 1.3 channel on loopback (the node's certificate) and a
real local TCP connection, with no QUIC stream around it. The far end of the
channel is the test, speaking the channel's framing by hand (a 4-byte length,
then the bytes; 0 is the half-close)."""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import socket
import ssl
import struct
import threading
from collections.abc import Callable, Iterator

import pytest

from gpumesh.identity.keys import Identity
from gpumesh.transport.channel import (
    TICKET_BYTES,
    Listener,
    MemoryChannel,
    dial_memory,
    server_context,
)
from gpumesh.transport.tcpstream import (
    CHANNEL_CHUNK,
    _ChannelError,
    _SocketError,
    _Splice,
    _Stopped,
)

CEILING = 30.0
_LENGTH = struct.Struct(">I")


def _tls_pair() -> tuple[MemoryChannel, ssl.SSLSocket]:
    """A data channel on loopback, opened as a desktop connection opens it: (the
    splice's end, TLS on memory buffers; the far end, Python's TLS socket)."""
    identity = Identity.generate()
    ticket = secrets.token_bytes(TICKET_BYTES)
    listener = Listener("127.0.0.1", server_context(identity), ticket, peer="127.0.0.1")
    result: list[ssl.SSLSocket] = []
    thread = threading.Thread(target=lambda: result.append(listener.accept(CEILING).sock))
    thread.start()
    near = dial_memory("127.0.0.1", listener.port, identity.public_key, ticket)
    thread.join(CEILING)
    return near, result[0]


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A local TCP connection: (the splice's end, the local program's)."""
    listener = socket.create_server(("127.0.0.1", 0))
    with listener:
        program = socket.create_connection(listener.getsockname())
        ours, _ = listener.accept()
    return ours, program


class Moving:
    """A splice running on its thread, and what it ended with."""

    def __init__(self, splice: _Splice) -> None:
        self.splice = splice
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.splice.run()
        except BaseException as exc:
            self.error = exc
        finally:
            self.splice.close()

    def ended(self) -> BaseException | None:
        self.thread.join(CEILING)
        assert not self.thread.is_alive(), "the splice did not end"
        return self.error


@pytest.fixture
def spliced() -> Iterator[tuple[Moving, socket.socket, ssl.SSLSocket]]:
    """(the running splice, the local program's socket, the channel's far end)."""
    near, far = _tls_pair()
    ours, program = _tcp_pair()
    moving = Moving(_Splice(ours, near))
    for sock in (program, far):
        sock.settimeout(CEILING)
    try:
        yield moving, program, far
    finally:
        moving.splice.stop()
        moving.thread.join(CEILING)
        for sock in (program, far):
            sock.close()


def _read_exactly(recv: Callable[[int], bytes], count: int) -> bytes:
    got = b""
    while len(got) < count:
        piece = recv(count - len(got))
        assert piece, f"ended after {len(got)} of {count} bytes"
        got += piece
    return got


def _pieces_until_end(far: ssl.SSLSocket) -> bytes:
    """What the far end receives, piece by piece, up to the half-close."""
    data = b""
    while length := _LENGTH.unpack(_read_exactly(far.recv, 4))[0]:
        assert length <= CHANNEL_CHUNK
        data += _read_exactly(far.recv, length)
    return data


def _until_eof(sock: socket.socket) -> bytes:
    data = b""
    while piece := sock.recv(1 << 20):
        data += piece
    return data


def test_both_ways_with_half_close_then_it_ends_cleanly(
    spliced: tuple[Moving, socket.socket, ssl.SSLSocket],
) -> None:
    moving, program, far = spliced
    up, down = os.urandom(5 * CHANNEL_CHUNK + 7), os.urandom(3 * CHANNEL_CHUNK + 11)

    def send() -> None:
        program.sendall(up)
        program.shutdown(socket.SHUT_WR)

    sender = threading.Thread(target=send)
    sender.start()
    assert _pieces_until_end(far) == up  # the program's EOF arrived as a piece of 0
    # The far side still sends after the program's half-close: it is read to the end.
    for start in range(0, len(down), 100_000):
        chunk = down[start : start + 100_000]
        far.sendall(_LENGTH.pack(len(chunk)) + chunk)
    far.sendall(_LENGTH.pack(0))
    assert _until_eof(program) == down  # the far side's half-close is the program's EOF
    sender.join(CEILING)
    assert moving.ended() is None


def test_small_messages_go_back_and_forth_one_at_a_time(
    spliced: tuple[Moving, socket.socket, ssl.SSLSocket],
) -> None:
    _moving, program, far = spliced
    for index in range(200):
        request = os.urandom(1 + index % 64)
        program.sendall(request)
        (length,) = _LENGTH.unpack(_read_exactly(far.recv, 4))
        assert _read_exactly(far.recv, length) == request  # nothing waits for more
        far.sendall(_LENGTH.pack(len(request)) + request[::-1])
        assert _read_exactly(program.recv, len(request)) == request[::-1]


@pytest.mark.parametrize(
    ("sent", "why"),
    [
        (_LENGTH.pack(CHANNEL_CHUNK + 1), "over"),
        (_LENGTH.pack(3) + b"abc" + _LENGTH.pack(0) + b"x", "bytes followed the end"),
        (_LENGTH.pack(10) + b"abc", "ended in the middle"),
    ],
)
def test_a_malformed_or_cut_channel_is_an_error(
    spliced: tuple[Moving, socket.socket, ssl.SSLSocket], sent: bytes, why: str
) -> None:
    moving, _program, far = spliced
    far.sendall(sent)
    if why == "ended in the middle":
        far.close()
    error = moving.ended()
    assert isinstance(error, _ChannelError)
    assert why in str(error)


def test_stop_lets_go_at_once_and_closes_both_sockets(
    spliced: tuple[Moving, socket.socket, ssl.SSLSocket],
) -> None:
    moving, program, far = spliced
    program.sendall(b"hello")
    assert _read_exactly(far.recv, 9)[4:] == b"hello"
    moving.splice.stop()  # from another thread, while it waits on both sockets
    assert isinstance(moving.ended(), _Stopped)
    assert program.recv(1) == b""  # its socket to the program is closed
    with contextlib.suppress(ConnectionResetError, ssl.SSLError):
        assert far.recv(1) == b""  # and the channel


def _fill_until_blocked(send: Callable[[bytes], int]) -> int:
    """Send until the far side's buffers are full (nothing reads them); bytes sent."""
    block, total = b"\0" * 65536, 0
    with contextlib.suppress(BlockingIOError, ssl.SSLWantWriteError, TimeoutError):
        while True:
            total += send(block)
    return total


def test_each_direction_moves_while_the_other_is_held_back(
    spliced: tuple[Moving, socket.socket, ssl.SSLSocket],
) -> None:
    """The far side reads nothing, so the up direction stops (back-pressure); the
    down direction still carries the far side's messages to the program, and the
    held-back bytes all arrive once the far side reads again."""
    moving, program, far = spliced
    program.settimeout(1.0)
    sent = _fill_until_blocked(program.send)  # stops once the channel is full too
    program.settimeout(CEILING)
    for index in range(20):
        message = f"down {index}".encode()
        far.sendall(_LENGTH.pack(len(message)) + message)
        assert _read_exactly(program.recv, len(message)) == message
    program.shutdown(socket.SHUT_WR)
    assert len(_pieces_until_end(far)) == sent
    far.sendall(_LENGTH.pack(0))
    assert program.recv(1) == b""
    assert moving.ended() is None


def test_down_does_not_send_the_records_up_has_not_sent_yet(
    spliced: tuple[Moving, socket.socket, ssl.SSLSocket],
) -> None:
    """Up has encrypted a piece and waits its turn to send it (on a full channel it
    waits for as long as the far side reads nothing): down still passes the far
    side's bytes on, without sending up's records itself, and they leave in order
    once up sends again."""
    moving, program, far = spliced
    splice = moving.splice
    with splice._sending:  # up's turn to send, held as a blocked send holds it
        with splice._tls:
            splice.channel.tls.write(_LENGTH.pack(2) + b"up")
        for index in range(3):
            message = f"down {index}".encode()
            far.sendall(_LENGTH.pack(len(message)) + message)
            assert _read_exactly(program.recv, len(message)) == message
    program.sendall(b"next")
    for expected in (b"up", b"next"):
        (length,) = _LENGTH.unpack(_read_exactly(far.recv, 4))
        assert _read_exactly(far.recv, length) == expected


def test_stop_lets_go_while_the_local_program_reads_nothing(
    spliced: tuple[Moving, socket.socket, ssl.SSLSocket],
) -> None:
    """Down is blocked sending to a program that does not read (and up waits on the
    program): a stop still ends both at once and closes the sockets."""
    moving, program, far = spliced
    piece = _LENGTH.pack(CHANNEL_CHUNK) + os.urandom(CHANNEL_CHUNK)
    far.setblocking(False)
    out = memoryview(piece * 16)  # far more than the program's socket holds
    while out:  # until the splice stops reading the channel (or all went)
        try:
            out = out[far.send(out) :]
        except ssl.SSLWantWriteError:
            if not select.select([], [far], [], 0.5)[1]:
                break
    moving.splice.stop()
    assert isinstance(moving.ended(), _Stopped)
    with contextlib.suppress(ConnectionResetError):
        while program.recv(1 << 20):  # what was delivered, then the close
            pass


def test_stop_lets_go_while_the_channel_takes_nothing(
    spliced: tuple[Moving, socket.socket, ssl.SSLSocket],
) -> None:
    """Up is waiting for a full channel (the far side reads nothing), down for the
    far side: a stop ends both at once."""
    moving, program, _far = spliced
    program.settimeout(1.0)
    _fill_until_blocked(program.send)
    moving.splice.stop()
    assert isinstance(moving.ended(), _Stopped)


def test_a_reset_local_connection_ends_both_directions(
    spliced: tuple[Moving, socket.socket, ssl.SSLSocket],
) -> None:
    """The program resets its connection while the far side is silent: the splice
    ends with the local socket's error instead of waiting on the channel."""
    moving, program, far = spliced
    program.sendall(b"hi")
    assert _read_exactly(far.recv, 6)[4:] == b"hi"
    far.sendall(_LENGTH.pack(2) + b"yo")
    assert _read_exactly(program.recv, 2) == b"yo"
    program.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    program.close()
    error = moving.ended()
    assert isinstance(error, _SocketError)
