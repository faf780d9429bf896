"""The framing of a shell's byte stream between the CLI and the node process.

``gpumesh exec`` asks the node process for a shell (``POST /api/v1/shells``) and
then carries the terminal's bytes on a connection of their own
(:mod:`gpumesh.daemon.shells`). Each frame is a kind (one byte), a length (four
bytes, big-endian) and that many bytes. Standard library only: the thin CLI
imports this.

From the CLI: :data:`TOKEN` (first, once), :data:`DATA` (keys or piped input),
:data:`RESIZE` (rows, cols), :data:`EOF` (the input ended). From the node process:
:data:`STARTED` (the program runs: a terminal may go raw now), :data:`DATA`
(output), :data:`PULL` (the provider's image pull, JSON), :data:`EXIT` (the exit
code, the last frame) or :data:`FAILED` (``{code, message}``, the last frame).
"""

from __future__ import annotations

import asyncio
import struct

__all__ = [
    "DATA",
    "EOF",
    "EXIT",
    "FAILED",
    "MAX_FRAME",
    "PULL",
    "RESIZE",
    "STARTED",
    "TOKEN",
    "FrameError",
    "frame",
    "read_frame",
    "resize_frame",
    "resize_of",
]

TOKEN = b"T"
DATA = b"D"
RESIZE = b"R"
EOF = b"E"
STARTED = b"S"
PULL = b"P"
EXIT = b"X"
FAILED = b"F"

MAX_FRAME = 1 << 20
"""The most bytes one frame carries (a reader refuses more)."""

_HEAD = struct.Struct(">cI")
_SIZE = struct.Struct(">HH")


class FrameError(Exception):
    """The other end sent something that is not a frame."""


def frame(kind: bytes, payload: bytes = b"") -> bytes:
    return _HEAD.pack(kind, len(payload)) + payload


def resize_frame(rows: int, cols: int) -> bytes:
    return frame(RESIZE, _SIZE.pack(max(0, min(rows, 65535)), max(0, min(cols, 65535))))


def resize_of(payload: bytes) -> tuple[int, int]:
    if len(payload) != _SIZE.size:
        raise FrameError("a resize frame of the wrong length")
    rows, cols = _SIZE.unpack(payload)
    return rows, cols


async def read_frame(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """The next frame's kind and payload; None when the stream ended between frames."""
    try:
        head = await reader.readexactly(_HEAD.size)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise FrameError("the stream ended inside a frame header") from None
        return None
    kind, length = _HEAD.unpack(head)
    if length > MAX_FRAME:
        raise FrameError(f"a frame of {length} bytes (at most {MAX_FRAME})")
    try:
        payload = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise FrameError("the stream ended inside a frame") from None
    return kind, payload
