"""An interactive container's terminal (``gpumesh exec``), attached through the
engine's raw socket."""

from __future__ import annotations

import contextlib
import logging
import socket
from typing import Any

from gpumesh.errors import AgentError

__all__ = ["AttachedTerminal"]

logger = logging.getLogger(__name__)

_ATTACH_READ = 64 * 1024


class AttachedTerminal:
    """A :class:`~gpumesh.runtime.base.Terminal` over the engine's hijacked attach socket.

    With a TTY the socket carries the terminal's bytes as they are; without
    one, the engine multiplexes stdout and stderr into frames (``u8 stream,
    3 zero bytes, u32 length``), which are unwrapped here and merged.
    """

    def __init__(self, stream: Any, tty: bool) -> None:
        # The SDK hands back a SocketIO over the real socket; the socket itself
        # is needed for sendall and half-close.
        self._stream = stream
        self._sock: socket.socket = getattr(stream, "_sock", stream)
        self._tty = tty
        self._header = bytearray()
        self._left = 0
        self._closed = False

    def read(self) -> bytes:
        while True:
            try:
                data = self._sock.recv(_ATTACH_READ)
            except OSError as exc:
                if not self._closed:
                    logger.debug("attach socket read failed: %s", exc)
                return b""
            if not data or self._tty:
                return data
            payload = self._unframe(data)
            if payload:
                return payload

    def _unframe(self, data: bytes) -> bytes:
        out = bytearray()
        view = memoryview(data)
        while view:
            if self._left == 0:
                need = 8 - len(self._header)
                self._header += view[:need]
                view = view[need:]
                if len(self._header) == 8:
                    self._left = int.from_bytes(self._header[4:8], "big")
                    self._header.clear()
                continue
            piece = view[: self._left]
            out += piece
            self._left -= len(piece)
            view = view[len(piece) :]
        return bytes(out)

    def write(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise AgentError(f"the container's stdin is closed: {exc.strerror or exc}") from exc

    def close_input(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed = True
        # shutdown wakes a recv blocked in another thread; close alone may not.
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._stream.close()
        with contextlib.suppress(OSError):
            self._sock.close()
