"""One TCP connection carried over one stream: the byte pump of desktop tunnels.

Both ends of a tunnel run :func:`pump` on their side's socket and the request's
stream. Bytes read from the socket leave as DATA frames within the stream's
credit, so a slow far side stops the local reads (back-pressure end to end);
DATA frames received are written to the socket and drained before the next is
read. An empty DATA frame is a half-close: the socket's EOF becomes one, and one
received shuts the socket's write side. The stream is finished once both
directions ended. A failed stream (a refusal, a reset, its link closed) closes
the socket; a failed socket resets the stream, so the far side's socket closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import TYPE_CHECKING, Any

from gpumesh.errors import ConnectionLostError, GPUMeshError, ProtocolError, error_from_code
from gpumesh.protocol.framing import FrameKind
from gpumesh.protocol.messages import Refusal, decode_message
from gpumesh.transport.stream import DATA_CHUNK

if TYPE_CHECKING:
    from gpumesh.transport.stream import Stream

__all__ = ["READ_LIMIT", "pump"]

READ_LIMIT = 4 * DATA_CHUNK
"""The StreamReader buffer for a tunnelled socket (``limit=`` of asyncio's
open_connection/start_server): large enough that one read fills a DATA frame."""


class _SocketError(Exception):
    """The local socket failed (reset, broken pipe): the stream is reset for it."""


async def pump(stream: Stream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Carry the connection both ways until both directions ended; then finish the
    stream and close the socket. Raises what ended it early (a refusal from the far
    side as its error; ConnectionLostError for a reset socket or stream)."""
    up = asyncio.create_task(_socket_to_stream(stream, reader))
    down = asyncio.create_task(_stream_to_socket(stream, writer))
    failed = asyncio.create_task(stream.wait_failed())
    pending: set[asyncio.Task[Any]] = {up, down}
    try:
        while pending:
            done, pending = await asyncio.wait(
                pending | {failed}, return_when=asyncio.FIRST_COMPLETED
            )
            pending.discard(failed)
            for task in done:
                if task is failed:
                    if not down.done():  # a refusal still queued says more than a reset
                        await asyncio.wait({down}, timeout=0.5)
                    if down.done() and down.exception() is not None:
                        down.result()
                    raise failed.result()
                task.result()
        stream.finish()
    except _SocketError as exc:
        stream.abort()
        raise ConnectionLostError(f"the local connection failed: {exc}") from None
    except GPUMeshError:
        stream.abort()  # the far side ended it (a refusal, a reset): our side goes too
        raise
    finally:
        for task in (up, down, failed):
            task.cancel()
        for task in (up, down, failed):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        writer.close()
        with contextlib.suppress(OSError, asyncio.CancelledError):
            await writer.wait_closed()


async def _socket_to_stream(stream: Stream, reader: asyncio.StreamReader) -> None:
    while True:
        try:
            data = await reader.read(DATA_CHUNK)
        except OSError as exc:
            raise _SocketError(exc.strerror or str(exc)) from None
        if not data:
            stream.end_data()
            return
        await stream.send_data(data)


async def _stream_to_socket(stream: Stream, writer: asyncio.StreamWriter) -> None:
    while True:
        frame = await stream.read_frame()
        if frame is None or (frame.kind is FrameKind.DATA and not frame.body):
            # The far side's EOF (an empty DATA frame; FIN alone from a peer that
            # ended at once): ours to pass on. Its side sends nothing more.
            _shut_write(writer)
            return
        if frame.kind is FrameKind.MESSAGE:
            message = decode_message(frame.body)
            if isinstance(message, Refusal):
                raise error_from_code(message.code, message.message)
            raise ProtocolError(f"peer sent {type(message).__name__} inside a desktop connection")
        writer.write(frame.body)
        try:
            await writer.drain()
        except OSError as exc:
            raise _SocketError(exc.strerror or str(exc)) from None


def _shut_write(writer: asyncio.StreamWriter) -> None:
    """TCP half-close: the local program reads EOF and may still answer."""
    if writer.can_write_eof():
        with contextlib.suppress(OSError, RuntimeError):
            writer.write_eof()
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
