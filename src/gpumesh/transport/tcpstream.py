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
import ssl
import struct
from typing import TYPE_CHECKING, Any

from gpumesh.errors import ConnectionLostError, GPUMeshError, ProtocolError, error_from_code
from gpumesh.protocol.framing import FrameKind
from gpumesh.protocol.messages import Refusal, decode_message
from gpumesh.transport.stream import DATA_CHUNK

if TYPE_CHECKING:
    from gpumesh.transport.stream import Stream

__all__ = ["CHANNEL_CHUNK", "READ_LIMIT", "pump", "splice"]

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


# --- over a data channel ---------------------------------------------------------------------

CHANNEL_CHUNK = 1024 * 1024
"""Most bytes per piece on a desktop data channel."""
_PIECE = struct.Struct(">I")
_JOINED = 64 * 1024
"""Pieces up to this size leave joined to their length (a copy, but one TLS record)."""

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def splice(stream: Stream, local: Streams, channel: Streams) -> None:
    """Carry the connection both ways over a data channel (TLS on TCP) instead of the
    stream, until both directions ended; then finish the stream and close both.

    On the channel each piece is its length (4 bytes) then its bytes; a length of
    0 is a half-close, passed on to the local socket. The request's stream stays
    open beside it, for what is not bytes: a refusal on it (access revoked, the
    share stopped) ends the connection with that error, and a far side gone
    (the stream failed, the channel broke) closes it. Raises as :func:`pump`.
    """
    up = asyncio.create_task(_to_channel(local[0], channel[1]))
    down = asyncio.create_task(_from_channel(channel[0], local[1]))
    watch = asyncio.create_task(_refusal_on(stream))
    pending: set[asyncio.Task[Any]] = {up, down}
    try:
        while pending:
            done, pending = await asyncio.wait(
                pending | {watch}, return_when=asyncio.FIRST_COMPLETED
            )
            pending.discard(watch)
            for task in done:
                task.result()  # a refusal, a broken socket or channel
        stream.finish()
    except _SocketError as exc:
        stream.abort()
        raise ConnectionLostError(f"the local connection failed: {exc}") from None
    except _ChannelError as exc:
        # A refusal sent as the channel was cut says why; else the channel broke.
        if not watch.done():
            await asyncio.wait({watch}, timeout=0.5)
        if watch.done() and not watch.cancelled() and watch.exception() is not None:
            watch.result()
        stream.abort()
        raise ConnectionLostError(f"the data channel broke: {exc}") from None
    except GPUMeshError:
        stream.abort()
        raise
    finally:
        for task in (up, down, watch):
            task.cancel()
        for task in (up, down, watch):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for _, writer in (local, channel):
            writer.close()
        for _, writer in (local, channel):
            with contextlib.suppress(OSError, asyncio.CancelledError, ssl.SSLError):
                await writer.wait_closed()


class _ChannelError(Exception):
    """The data channel failed (reset, cut, a malformed piece)."""


async def _to_channel(reader: asyncio.StreamReader, channel: asyncio.StreamWriter) -> None:
    while True:
        try:
            data = await reader.read(CHANNEL_CHUNK)
        except OSError as exc:
            raise _SocketError(exc.strerror or str(exc)) from None
        try:
            if len(data) <= _JOINED:  # one TLS record and one send for a small piece
                channel.write(_PIECE.pack(len(data)) + data)
            else:
                channel.write(_PIECE.pack(len(data)))
                channel.write(data)
            await channel.drain()
        except (OSError, RuntimeError) as exc:
            raise _ChannelError(str(exc) or type(exc).__name__) from None
        if not data:
            return


async def _from_channel(channel: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Pieces from the channel to the socket, passed on as they arrive (a piece is
    not gathered whole first: no copy of it here, and no wait for its end)."""
    header = bytearray()
    left = 0
    """Bytes of the current piece still to come; 0: a length is next."""
    while True:
        try:
            data = await channel.read(CHANNEL_CHUNK)
        except (OSError, ssl.SSLError) as exc:
            raise _ChannelError(str(exc) or type(exc).__name__) from None
        if not data:
            raise _ChannelError("it ended in the middle of the connection")
        view, pos = memoryview(data), 0
        while pos < len(view):
            if left:
                take = min(left, len(view) - pos)
                writer.write(view[pos : pos + take])
                left -= take
                pos += take
                continue
            need = _PIECE.size - len(header)
            header += view[pos : pos + need]
            pos += min(need, len(view) - pos)
            if len(header) < _PIECE.size:
                break
            (left,) = _PIECE.unpack(header)
            header.clear()
            if left > CHANNEL_CHUNK:
                raise _ChannelError(f"a piece of {left} bytes, over {CHANNEL_CHUNK}")
            if not left:  # the far side's half-close; nothing may follow
                if pos < len(view):
                    raise _ChannelError("bytes followed the end of the connection")
                _shut_write(writer)
                return
        try:
            await writer.drain()
        except OSError as exc:
            raise _SocketError(exc.strerror or str(exc)) from None


async def _refusal_on(stream: Stream) -> None:
    """Wait on the request's stream beside a channel: a refusal is raised; its end
    (the far side finished) is no error, and then this waits on, doing nothing."""
    while True:
        frame = await stream.read_frame()
        if frame is None:
            await asyncio.Event().wait()  # finished: the channel carries the rest
        assert frame is not None
        if frame.kind is FrameKind.MESSAGE:
            message = decode_message(frame.body)
            if isinstance(message, Refusal):
                raise error_from_code(message.code, message.message)
            raise ProtocolError(f"peer sent {type(message).__name__} beside a data channel")
        raise ProtocolError("peer sent data on the stream of a connection on a data channel")
