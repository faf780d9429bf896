"""Frames on a QUIC stream, without I/O.

Every frame is a 5-byte header (``u8 kind``, ``u32 length``, big endian) and a
body. Kinds:

* ``MESSAGE``: one encoded message (at most ``MAX_MESSAGE_FRAME`` bytes);
* ``DATA``: raw bulk bytes (at most ``MAX_DATA_FRAME``); an empty ``DATA``
  frame ends a bulk section;
* ``CREDIT``: 8-byte count of bulk bytes the receiver has consumed, sent back
  so the sender never has more than a window in flight (QUIC's own flow
  control releases credit when bytes reach our reader, not when the
  application uses them, so it alone cannot bound our buffers).

A header announcing a body over the limit is refused before the body arrives.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from gpumesh.errors import FrameTooLargeError, ProtocolError
from gpumesh.protocol.messages import MAX_DATA_FRAME, MAX_MESSAGE_FRAME

__all__ = ["HEADER_SIZE", "Frame", "FrameDecoder", "FrameKind", "encode_frame"]

_HEADER = struct.Struct("!BI")
HEADER_SIZE = _HEADER.size


class FrameKind(enum.IntEnum):
    MESSAGE = 1
    DATA = 2
    CREDIT = 3


_LIMITS = {
    FrameKind.MESSAGE: MAX_MESSAGE_FRAME,
    FrameKind.DATA: MAX_DATA_FRAME,
    FrameKind.CREDIT: 8,
}


@dataclass(frozen=True, slots=True)
class Frame:
    kind: FrameKind
    body: bytes


def encode_frame(kind: FrameKind, body: bytes | memoryview) -> bytes:
    if len(body) > _LIMITS[kind]:
        raise FrameTooLargeError(
            f"{kind.name.lower()} frame of {len(body)} bytes exceeds the {_LIMITS[kind]}-byte limit"
        )
    return _HEADER.pack(kind, len(body)) + bytes(body)


def encode_header(kind: FrameKind, length: int) -> bytes:
    """Only the header, for callers that send a large body without copying it."""
    if length > _LIMITS[kind]:
        raise FrameTooLargeError(f"{kind.name.lower()} frame of {length} bytes is too large")
    return _HEADER.pack(kind, length)


class FrameDecoder:
    """Turns stream bytes into frames; keeps at most one partial frame buffered."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Frame]:
        """Add received bytes; return every frame now complete."""
        self._buffer += data
        frames: list[Frame] = []
        offset = 0
        buf = self._buffer
        while len(buf) - offset >= HEADER_SIZE:
            kind_value, length = _HEADER.unpack_from(buf, offset)
            try:
                kind = FrameKind(kind_value)
            except ValueError:
                raise ProtocolError(f"peer sent an unknown frame kind {kind_value}") from None
            if length > _LIMITS[kind]:
                raise FrameTooLargeError(
                    f"peer announced a {kind.name.lower()} frame of {length} bytes, over "
                    f"the {_LIMITS[kind]}-byte limit"
                )
            end = offset + HEADER_SIZE + length
            if end > len(buf):
                break
            frames.append(Frame(kind, bytes(buf[offset + HEADER_SIZE : end])))
            offset = end
        if offset:
            del buf[:offset]
        return frames

    def at_frame_boundary(self) -> bool:
        return not self._buffer
