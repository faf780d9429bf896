"""One TCP connection carried over one stream: the byte pump of desktop tunnels.

Both ends of a tunnel run :func:`pump` on their side's socket and the request's
stream. Bytes read from the socket leave as DATA frames within the stream's
credit, so a slow far side stops the local reads (back-pressure end to end);
DATA frames received are written to the socket and drained before the next is
read. An empty DATA frame is a half-close: the socket's EOF becomes one, and one
received shuts the socket's write side. The stream is finished once both
directions ended. A failed stream (a refusal, a reset, its link closed) closes
the socket; a failed socket resets the stream, so the far side's socket closes.

Over a data channel (:func:`splice`) the bytes skip the event loop: two threads
per connection, one per direction, move them between the local socket and the
channel's plain TCP socket, TLS running on memory buffers between them, and the
loop only watches the request's stream for a refusal. Python's TLS on asyncio
wakes the loop per chunk, and its TLS socket makes a system call (or two) per
16 KiB record; here one ``recv`` feeds many records and many leave in one send.
When both ends agreed on it, the channel leaves TLS records behind once each end
has sent a random through them: its pieces move as sealed frames
(:mod:`gpumesh.transport.sealing`), one AEAD call and one system call each way
per frame, with no lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import struct
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from gpumesh.errors import ConnectionLostError, GPUMeshError, ProtocolError, error_from_code
from gpumesh.protocol.framing import FrameKind
from gpumesh.protocol.messages import Refusal, decode_message
from gpumesh.transport.sealing import (
    HEADER,
    RANDOM_BYTES,
    TAG,
    Opener,
    ReadFailed,
    Sealer,
    SealError,
    SendFailed,
    derive_keys,
)
from gpumesh.transport.stream import DATA_CHUNK

if TYPE_CHECKING:
    from gpumesh.transport.channel import MemoryChannel
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
_TLS_SLICE = 128 * 1024
"""Most bytes one call into TLS takes or one read of the channel brings: eight
records per system call, and the copies a memory buffer costs stay in cache."""


async def splice(
    stream: Stream,
    local: socket.socket,
    channel: MemoryChannel,
    *,
    sealed_to: bytes | None = None,
    dialler: bool = False,
) -> None:
    """Carry the connection both ways over a data channel (TLS on TCP) instead of the
    stream, until both directions ended; then finish the stream. Both sockets are
    closed when it returns, whatever happened.

    On the channel each piece is its length (4 bytes) then its bytes; a length of
    0 is a half-close, passed on to the local socket. The bytes move on threads
    of their own (:class:`_Splice`: one per direction, TLS on memory buffers, a
    system call per many records), and the event loop
    keeps only the request's stream beside it, for what is not bytes: a refusal
    on it (access revoked, the share stopped) ends the connection with that error,
    and a far side gone (the stream failed, the channel broke) closes it. Raises
    as :func:`pump`.

    ``sealed_to``: the binding of the QUIC session whose request agreed on sealed
    frames (:func:`~gpumesh.transport.quicsetup.session_binding`; None: TLS records
    carry the pieces); ``dialler``: this end dialled the channel. Once each end
    has sent :data:`~gpumesh.transport.sealing.RANDOM_BYTES` random bytes through
    the TLS, the pieces move as sealed frames (:mod:`gpumesh.transport.sealing`)
    under keys bound to that session: a frame per read, one AEAD call and one
    ``sendall`` each; an empty frame is the half-close.
    """
    splicer = _Splice(local, channel, sealed_to=sealed_to, dialler=dialler)
    loop = asyncio.get_running_loop()
    moved: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if moved.done():
            return
        if error is None:
            moved.set_result(None)
        else:
            moved.set_exception(error)

    def carry() -> None:
        error: BaseException | None = None
        try:
            splicer.run()
        except BaseException as exc:  # reported to the loop; the thread ends here
            error = exc
        finally:
            splicer.close()
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
            loop.call_soon_threadsafe(settle, error)

    watch = asyncio.create_task(_refusal_on(stream))
    try:
        threading.Thread(target=carry, name="gpumesh-desktop", daemon=True).start()
    except BaseException:
        splicer.close()
        watch.cancel()
        raise
    try:
        await asyncio.wait({moved, watch}, return_when=asyncio.FIRST_COMPLETED)
        if watch.done():
            watch.result()  # a refusal, or the stream failed
        moved.result()
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
        watch.cancel()
        splicer.stop()
        # The thread lets go of the sockets (and closes them) at once once stopped.
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.shield(moved)
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watch


def _reason(exc: BaseException | None) -> str:
    """An OSError's words for a one-line message."""
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc)


class _ChannelError(Exception):
    """The data channel failed (reset, cut, a malformed piece)."""


class _Stopped(Exception):
    """The event loop's side asked the thread to let go."""


class _Splice:
    """Both directions of one connection, each on a thread of its own.

    A direction's thread sleeps in the kernel until its bytes come and goes
    straight back to sleep once they are passed on: a small message costs one
    wake-up, one read and one write per hop, with no loop over both directions
    between them (Python releases the GIL in each of those calls).

    The channel's TLS runs on memory buffers (:class:`MemoryChannel`), so the
    channel's socket is a plain blocking one and no system call is made under
    the lock OpenSSL needs. Up (the thread that calls :meth:`run`): a blocking
    read of the local socket straight into the buffer behind a 4-byte length,
    that piece encrypted whole (as many records as it takes) and the records sent
    in one blocking ``sendall`` before the next read (back-pressure: a full channel
    stops the reads). Down (a second thread): one ``recv`` of up to
    :data:`CHANNEL_CHUNK` of the channel's bytes, the records in them decrypted
    back to back into the buffer, and the pieces' bytes sent to the local socket
    from there (a blocking send: a local program that does not read stops the
    channel's reads).

    OpenSSL never sees two threads at once: each call on the TLS object and its
    buffers is made under one lock, never held in a system call. Encrypted bytes
    are taken from the outgoing buffer and sent under a second lock, so records
    leave in the order they were made, whichever thread sends them. :meth:`stop`
    (any thread) or a failure in either direction stops both: both sockets are
    shut down, which wakes a thread blocked on either. Nothing here touches the
    event loop.

    Sealed (``sealed_to``, the QUIC session's binding): :meth:`_switch` first (the
    randoms through TLS, the keys), then :meth:`_up_sealed` and :meth:`_down_sealed`
    in place of the two directions above, on the same threads with the same stops
    and shutdowns.
    """

    def __init__(
        self,
        local: socket.socket,
        channel: MemoryChannel,
        *,
        sealed_to: bytes | None = None,
        dialler: bool = False,
    ) -> None:
        self.local = local
        self.channel = channel
        self._sock = channel.sock
        self._sealed = sealed_to is not None
        self._binding = sealed_to or b""
        self._dialler = dialler
        self._sealer: Sealer
        self._opener: Opener
        """Both made by :meth:`_switch`, on a sealed channel only."""
        for sock in (local, self._sock):
            sock.setblocking(True)
            with contextlib.suppress(OSError):  # small pieces leave at once
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._tls = threading.Lock()
        """Held around every call into OpenSSL and its memory buffers."""
        self._sending = threading.Lock()
        """Held from taking encrypted bytes out of TLS until they are sent."""
        self._halted = False
        self._failure: BaseException | None = None
        """What broke first, in either direction (None: nothing, or :meth:`stop` came first)."""

    def stop(self) -> None:
        """Let go (any thread): both directions end, :meth:`run` with :class:`_Stopped`
        (the flag first, so a wake-up reads as a stop)."""
        if self._halted:
            return
        self._halted = True
        for sock in (self.local, self._sock):  # wakes a thread blocked on either
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.local.close()
        self.channel.close()

    def run(self) -> None:
        """Move bytes until both directions ended (blocking; raises what broke)."""
        ended: list[bool] = []
        up_move, down_move = self._up, self._down
        if self._sealed:
            if not self._direction(self._switch):
                if self._failure is not None:
                    raise self._failure
                raise _Stopped()
            up_move, down_move = self._up_sealed, self._down_sealed
        down = threading.Thread(
            target=lambda: ended.append(self._direction(down_move)),
            name="gpumesh-desktop-down",
            daemon=True,
        )
        down.start()
        up_ended = self._direction(up_move)
        down.join()
        if self._failure is not None:
            raise self._failure
        if not (up_ended and ended == [True]):
            raise _Stopped()

    def _direction(self, move: Callable[[], None]) -> bool:
        """Run one direction; whether it ended normally. A failure is kept for
        :meth:`run` (the first one only) and stops the other direction."""
        try:
            move()
        except _Stopped:
            return False
        except BaseException as exc:
            if self._failure is None and not self._halted:
                self._failure = exc
            self.stop()
            return False
        return True

    def _socket_error(self, exc: BaseException | None) -> Exception:
        """The local socket failed (or a stop's shutdown woke it: then :class:`_Stopped`)."""
        return _Stopped() if self._halted else _SocketError(_reason(exc))

    def _channel_error(self, exc: BaseException | None) -> Exception:
        if self._halted:
            return _Stopped()
        if isinstance(exc, OSError) and not isinstance(exc, ssl.SSLError):
            return _ChannelError(exc.strerror or str(exc))
        return _ChannelError(str(exc) or type(exc).__name__)

    def _flush(self) -> None:
        """Send what TLS has encrypted so far (blocking), in the order it was made."""
        with self._sending:
            with self._tls:
                out = self.channel.outgoing.read()
            if not out:
                return
            try:
                self._sock.sendall(out)
            except OSError as exc:
                raise self._channel_error(exc) from None

    def _up(self) -> None:
        """The local socket's bytes into TLS, a piece per read, until its EOF."""
        buffer = memoryview(bytearray(_PIECE.size + CHANNEL_CHUNK))
        room = buffer[_PIECE.size :]
        local, tls, lock = self.local, self.channel.tls, self._tls
        while True:
            try:
                count = local.recv_into(room)
            except OSError as exc:
                raise self._socket_error(exc) from None
            if self._halted:  # a stop's shutdown reads as an EOF
                raise _Stopped()
            _PIECE.pack_into(buffer, 0, count)
            out = buffer[: _PIECE.size + count]
            while out:  # a slice at a time: the copies into and out of TLS stay in cache
                try:
                    with lock:  # memory buffers take it all: no partial write
                        done = tls.write(out[:_TLS_SLICE])
                except ssl.SSLError as exc:
                    raise self._channel_error(exc) from None
                out = out[done:]
                self._flush()
            if not count:
                return

    def _down(self) -> None:
        """The channel's bytes into TLS, its records into the buffer, their pieces'
        bytes to the local socket, until the far side's half-close."""
        buffer = memoryview(bytearray(CHANNEL_CHUNK))
        raw = memoryview(bytearray(_TLS_SLICE))
        local, sock, lock = self.local, self._sock, self._tls
        tls, incoming, outgoing = self.channel.tls, self.channel.incoming, self.channel.outgoing
        header = bytearray()
        left = 0
        """Bytes of the current piece still to go to the local socket."""
        starved = False
        """TLS holds no whole record: the kernel's bytes come first."""
        while True:
            if starved:
                try:
                    got = sock.recv_into(raw)
                except OSError as exc:
                    raise self._channel_error(exc) from None
                if self._halted:
                    raise _Stopped()
                if not got:
                    raise _ChannelError("it ended in the middle of the connection")
                with lock:
                    incoming.write(raw[:got])
            fill, eof, starved, reply = 0, False, False, False
            while fill < CHANNEL_CHUNK:
                try:
                    with lock:
                        # Records the up direction encrypted sit there until its
                        # flush takes them, and that flush may wait on a full
                        # channel: only what this read adds is TLS's own answer.
                        made = outgoing.pending
                        try:
                            # given a buffer, it returns a count (typeshed says bytes)
                            got = cast(int, tls.read(CHANNEL_CHUNK - fill, buffer[fill:]))
                        finally:
                            reply = reply or outgoing.pending > made
                except ssl.SSLWantReadError:
                    starved = True
                    break
                except ssl.SSLError as exc:
                    raise self._channel_error(exc) from None
                if not got:
                    eof = True
                    break
                fill += got
                if not incoming.pending and not tls.pending():
                    # All taken: the kernel's bytes come next, with no exception to
                    # say so (the usual end of a small message, and of bulk at times).
                    starved = True
                    break
            if reply:  # TLS answered something (a key update): it goes out in order
                self._flush()
            pos = 0
            while pos < fill:
                if left:
                    end = pos + min(left, fill - pos)
                    try:
                        local.sendall(buffer[pos:end])
                    except OSError as exc:
                        raise self._socket_error(exc) from None
                    left -= end - pos
                    pos = end
                    continue
                if not header and fill - pos >= _PIECE.size:  # the usual case: no copy
                    (left,) = _PIECE.unpack_from(buffer, pos)
                    pos += _PIECE.size
                else:
                    take = min(_PIECE.size - len(header), fill - pos)
                    header += buffer[pos : pos + take]
                    pos += take
                    if len(header) < _PIECE.size:
                        break
                    (left,) = _PIECE.unpack(header)
                    header.clear()
                if left > CHANNEL_CHUNK:
                    raise _ChannelError(f"a piece of {left} bytes, over {CHANNEL_CHUNK}")
                if not left:
                    self._end_down(pos < fill)
                    return
            if eof:
                raise _ChannelError("it ended in the middle of the connection")
            if self._halted:
                raise _Stopped()

    # --- sealed frames ------------------------------------------------------------------

    def _switch(self) -> None:
        """Each end's random through the TLS, then the keys (bound to the QUIC session
        that agreed on them): the channel's bytes from here on are sealed frames (what
        the kernel brought past the far end's random is the first of them)."""
        tls, incoming, outgoing = self.channel.tls, self.channel.incoming, self.channel.outgoing
        sock = self._sock
        own = os.urandom(RANDOM_BYTES)
        try:
            tls.write(own)
        except ssl.SSLError as exc:
            raise self._channel_error(exc) from None
        self._flush()
        theirs = bytearray()
        while len(theirs) < RANDOM_BYTES:
            try:
                piece = tls.read(RANDOM_BYTES - len(theirs))
            except ssl.SSLWantReadError:
                try:
                    data = sock.recv(65536)
                except OSError as exc:
                    raise self._channel_error(exc) from None
                if self._halted:
                    raise _Stopped() from None
                if not data:
                    raise _ChannelError("it ended before its sealed frames began") from None
                incoming.write(data)
                continue
            except ssl.SSLError as exc:
                raise self._channel_error(exc) from None
            if not piece:
                raise _ChannelError("it ended before its sealed frames began")
            theirs += piece
        if tls.pending() or outgoing.pending:
            raise _ChannelError("TLS went on after the switch to sealed frames")
        first, second = (own, bytes(theirs)) if self._dialler else (bytes(theirs), own)
        up, down = derive_keys(first, second, self._binding)
        send, receive = (up, down) if self._dialler else (down, up)
        self._sealer = Sealer(send)
        self._opener = Opener(receive, incoming.read())

    def _up_sealed(self) -> None:
        """The local socket's bytes as sealed frames, a frame per read, until its EOF
        (sealed as an empty frame)."""
        sealer = self._sealer
        try:
            sealer.pump(self.local.recv_into, self._sock.sendall)
        except ReadFailed as exc:
            raise self._socket_error(exc.__cause__) from None
        except SendFailed as exc:
            raise self._channel_error(exc.__cause__) from None
        if self._halted:  # a stop's shutdown reads as an EOF
            raise _Stopped()
        end = memoryview(bytearray(HEADER + TAG))
        sealer.seal_into(b"", end)
        try:
            self._sock.sendall(end)
        except OSError as exc:
            raise self._channel_error(exc) from None

    def _down_sealed(self) -> None:
        """The channel's sealed frames opened, their bytes to the local socket, until
        the far side's half-close (its empty frame)."""
        try:
            self._opener.pump(self._sock.recv_into, self.local.sendall)
        except ReadFailed as exc:
            raise self._channel_error(exc.__cause__) from None
        except SendFailed as exc:
            raise self._socket_error(exc.__cause__) from None
        except SealError as exc:
            if self._halted:  # a stop's shutdown reads as a cut
                raise _Stopped() from None
            raise _ChannelError(str(exc)) from None
        self._end_down(False)

    def _end_down(self, more: bool) -> None:
        """The far side's half-close (a piece of 0), which nothing may follow: the
        local program reads EOF."""
        if more:
            raise _ChannelError("bytes followed the end of the connection")
        with contextlib.suppress(OSError):
            self.local.shutdown(socket.SHUT_WR)


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
