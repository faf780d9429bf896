"""The relay over TCP: the HTTP/1.1 upgrade that opens it and the frames after it.

Where UDP is blocked (a campus, hotel or corporate network that lets only
HTTPS out), a node reaches ``gpumesh-relay`` over TCP with TLS, on 443 by
default, so the connection looks like HTTPS to what sits between. Inside the
TLS a node asks for an upgrade as a browser asks for a WebSocket::

    GET /gpumesh/relay HTTP/1.1
    Host: relay.example.org:443
    Connection: Upgrade
    Upgrade: gpumesh-relay/1

    HTTP/1.1 101 Switching Protocols
    Connection: Upgrade
    Upgrade: gpumesh-relay/1

Anything else gets ``404 Not Found``, as from a web server. From then on both
ways carry the relay's own packets (:mod:`gpumesh.protocol.relay`), each
behind a 2-byte big-endian length: the same packets as over UDP, so the relay
applies the same rules to both. TLS here only makes the stream pass
middleboxes; nodes do not check the relay's certificate, since everything
that matters is authenticated end to end inside (the registration is signed,
the relayed QUIC is pinned to the peer's key).

An HTTP proxy (``HTTPS_PROXY``) is crossed with ``CONNECT`` first.

Nothing here does I/O.
"""

from __future__ import annotations

import struct

from gpumesh.errors import ProtocolError
from gpumesh.protocol.relay import MAX_PACKET

__all__ = [
    "FRAME_HEADER",
    "HEAD_END",
    "MAX_HEAD",
    "NOT_FOUND",
    "UPGRADE",
    "UPGRADED",
    "UPGRADE_PATH",
    "Deframer",
    "connect_request",
    "encode_frame",
    "encode_frames",
    "head_status",
    "is_upgrade_request",
    "upgrade_request",
]

UPGRADE = "gpumesh-relay/1"
UPGRADE_PATH = "/gpumesh/relay"
HEAD_END = b"\r\n\r\n"
MAX_HEAD = 8192
"""Longest HTTP head either side reads (a request, an answer, a proxy's answer)."""

UPGRADED = (
    f"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: {UPGRADE}\r\n\r\n"
).encode()
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"

_LENGTH = struct.Struct("!H")
FRAME_HEADER = _LENGTH.size


def upgrade_request(host: str) -> bytes:
    """What a node sends first inside the TLS: ask for the relay's stream."""
    return (
        f"GET {UPGRADE_PATH} HTTP/1.1\r\nHost: {host}\r\n"
        f"Connection: Upgrade\r\nUpgrade: {UPGRADE}\r\n\r\n"
    ).encode()


def connect_request(target: str, authorization: str = "") -> bytes:
    """``CONNECT host:port`` for an HTTP proxy; ``authorization`` is a header value or empty."""
    auth = f"Proxy-Authorization: {authorization}\r\n" if authorization else ""
    return f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth}\r\n".encode()


def _lines(head: bytes) -> list[str]:
    if len(head) > MAX_HEAD:
        raise ProtocolError(f"an HTTP head longer than {MAX_HEAD} bytes")
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError as exc:  # pragma: no cover - latin-1 decodes anything
        raise ProtocolError("an unreadable HTTP head") from exc
    return [line for line in text.split("\r\n") if line]


def head_status(head: bytes) -> tuple[int, str]:
    """``(status code, status line)`` of an HTTP answer's head; ProtocolError if it is none."""
    lines = _lines(head)
    parts = lines[0].split(" ", 2) if lines else []
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        shown = lines[0][:80] if lines else "nothing"
        raise ProtocolError(f"not an HTTP answer: {shown!r}")
    return int(parts[1]), " ".join(parts[1:])


def is_upgrade_request(head: bytes) -> bool:
    """Whether ``head`` asks for the relay's stream (else the answer is :data:`NOT_FOUND`)."""
    try:
        lines = _lines(head)
    except ProtocolError:
        return False
    if not lines:
        return False
    request = lines[0].split(" ")
    if len(request) != 3 or request[0] != "GET" or request[1] != UPGRADE_PATH:
        return False
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if colon:
            headers[name.strip().lower()] = value.strip()
    connection = {token.strip().lower() for token in headers.get("connection", "").split(",")}
    return "upgrade" in connection and headers.get("upgrade", "").lower() == UPGRADE


def encode_frame(packet: bytes) -> bytes:
    """One relay packet with its length in front."""
    if not 0 < len(packet) <= MAX_PACKET:
        raise ProtocolError(f"a relay packet of {len(packet)} bytes cannot be framed")
    return _LENGTH.pack(len(packet)) + packet


def encode_frames(packets: list[bytes]) -> bytes:
    """Several relay packets framed into one write."""
    return b"".join(encode_frame(packet) for packet in packets)


class Deframer:
    """Bytes read from the stream in, whole relay packets out.

    Holds at most one partial frame (:data:`MAX_PACKET` bytes and its length);
    a zero or oversized length is a :class:`ProtocolError` (the stream is then
    closed: it can never be resynchronised).
    """

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._buffer
        buffer += data
        packets: list[bytes] = []
        offset = 0
        while len(buffer) - offset >= FRAME_HEADER:
            (size,) = _LENGTH.unpack_from(buffer, offset)
            if not 0 < size <= MAX_PACKET:
                raise ProtocolError(f"a relay frame of {size} bytes (at most {MAX_PACKET})")
            end = offset + FRAME_HEADER + size
            if end > len(buffer):
                break
            packets.append(bytes(buffer[offset + FRAME_HEADER : end]))
            offset = end
        del buffer[:offset]
        return packets

    @property
    def pending(self) -> int:
        """Bytes held of a frame not yet complete."""
        return len(self._buffer)
