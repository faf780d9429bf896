"""One TCP connection carried over one stream: the byte pump of desktop tunnels.

Both ends of a tunnel run :func:`pump` on their side's socket and the request's
stream. Bytes read from the socket leave as DATA frames within the stream's
credit, so a slow far side stops the local reads (back-pressure end to end);
DATA frames received are written to the socket and drained before the next is
read. An empty DATA frame is a half-close: the socket's EOF becomes one, and one
received shuts the socket's write side. The stream is finished once both
directions ended. A failed stream (a refusal, a reset, its link closed) closes
the socket; a failed socket resets the stream, so the far side's socket closes.

Over a data channel (:func:`splice`) the bytes skip the event loop: one thread
per connection moves both directions between two plain non-blocking sockets
(the local one and the channel's TLS socket), and the loop only watches the
request's stream for a refusal. Python's TLS on asyncio copies each chunk
several times and wakes the loop per chunk; here a chunk is read into a reused
buffer and handed to OpenSSL (or the kernel) from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import ssl
import struct
import threading
from typing import TYPE_CHECKING, Any

try:  # not on Windows: there the channel is read on until a read would block
    import fcntl
    from termios import FIONREAD as _FIONREAD_VALUE

    _FIONREAD: int | None = _FIONREAD_VALUE
except ImportError:  # pragma: no cover - Windows
    _FIONREAD = None

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
_READ = 1
_WRITE = 2
_HAS_POLL = hasattr(select, "poll")


async def splice(stream: Stream, local: socket.socket, channel: ssl.SSLSocket) -> None:
    """Carry the connection both ways over a data channel (TLS on TCP) instead of the
    stream, until both directions ended; then finish the stream. Both sockets are
    closed when it returns, whatever happened.

    On the channel each piece is its length (4 bytes) then its bytes; a length of
    0 is a half-close, passed on to the local socket. The bytes move on a thread
    of their own (:class:`_Splice`: non-blocking sockets, one reused buffer per
    direction, no copy between the kernel's and OpenSSL's), and the event loop
    keeps only the request's stream beside it, for what is not bytes: a refusal
    on it (access revoked, the share stopped) ends the connection with that error,
    and a far side gone (the stream failed, the channel broke) closes it. Raises
    as :func:`pump`.
    """
    splicer = _Splice(local, channel)
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


class _ChannelError(Exception):
    """The data channel failed (reset, cut, a malformed piece)."""


class _Stopped(Exception):
    """The event loop's side asked the thread to let go."""


class _Splice:
    """Both directions of one connection on one thread, over non-blocking sockets.

    One thread owns the TLS socket, so OpenSSL never sees two threads at once;
    each direction still goes at its own pace: a direction whose next step would
    block waits (``poll``) while the other moves. Up: the local socket is read
    straight into the buffer behind a 4-byte length, and that piece is handed to
    TLS whole before the next read (back-pressure: a full channel stops the
    reads). Down: TLS records are decrypted into the buffer back to back while
    the kernel holds more, and the pieces' bytes go to the local socket from
    there before the next read. A step is tried only while its socket is known
    ready (``poll`` said so, or the last step did not drain it): a small message
    costs one wake-up, one read and one write per hop, and no exceptions.
    Nothing here touches the event loop; :meth:`stop` (any thread) wakes it to
    let go.
    """

    def __init__(self, local: socket.socket, channel: ssl.SSLSocket) -> None:
        self.local = local
        self.channel = channel
        self._wake, self._waker = socket.socketpair()
        for sock in (local, channel, self._wake, self._waker):
            sock.setblocking(False)
        for sock in (local, channel):
            with contextlib.suppress(OSError):  # small pieces leave at once
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._up = memoryview(bytearray(_PIECE.size + CHANNEL_CHUNK))
        self._up_out: memoryview | None = None
        """The framed piece TLS has not taken whole yet."""
        self._up_last = False
        """The piece out is the half-close (length 0)."""
        self.up_done = False
        self._down = memoryview(bytearray(CHANNEL_CHUNK))
        self._down_fill = 0
        self._down_pos = 0
        self._down_eof = False
        """The channel ended after the bytes in the buffer."""
        self._header = bytearray()
        self._left = 0
        """Bytes of the current piece still to go to the local socket."""
        self.down_done = False
        # What each socket is known ready for; cleared when a step would block.
        self._local_r = self._local_w = self._channel_r = self._channel_w = True
        self._stopping = False

    def stop(self) -> None:
        self._stopping = True  # seen between steps, while bytes keep moving
        with contextlib.suppress(OSError):  # wakes the poll
            self._waker.send(b"\0")

    def close(self) -> None:
        for sock in (self.local, self.channel, self._wake, self._waker):
            with contextlib.suppress(OSError):
                sock.close()

    def run(self) -> None:
        """Move bytes until both directions ended (blocking; raises what broke)."""
        poller = _Poller(self._wake, self.local, self.channel)
        while not (self.up_done and self.down_done):
            if self._stopping:
                raise _Stopped()
            # A step is called only when it can move (its socket known ready): a
            # small message then costs one call of each kind per hop.
            moved = False
            if not self.up_done and (self._local_r if self._up_out is None else self._channel_w):
                moved = self._step_up()
            if not self.down_done and (
                self._local_w
                if self._down_pos < self._down_fill
                else self._channel_r or self._down_eof
            ):
                moved = self._step_down() or moved
            if moved:
                continue
            want_local = want_channel = 0
            if not self.up_done:
                if self._up_out is None:
                    want_local |= _READ
                else:
                    want_channel |= _WRITE
            if not self.down_done:
                if self._down_pos < self._down_fill:
                    want_local |= _WRITE
                else:
                    want_channel |= _READ
            woke, local, channel = poller.wait(want_local, want_channel)
            if woke:
                raise _Stopped()
            self._local_r |= bool(local & _READ)
            self._local_w |= bool(local & _WRITE)
            self._channel_r |= bool(channel & _READ)
            self._channel_w |= bool(channel & _WRITE)

    def _step_up(self) -> bool:
        """One piece from the local socket into TLS; whether anything moved."""
        if self.up_done:
            return False
        moved = False
        if self._up_out is None:
            if not self._local_r:
                return False
            room = self._up[_PIECE.size :]
            try:
                count = self.local.recv_into(room)
            except (BlockingIOError, InterruptedError):
                self._local_r = False
                return False
            except OSError as exc:
                raise _SocketError(exc.strerror or str(exc)) from None
            if 0 < count < len(room):
                self._local_r = False  # drained; poll says when more comes
            _PIECE.pack_into(self._up, 0, count)
            self._up_out = self._up[: _PIECE.size + count]
            self._up_last = count == 0
            moved = True
        if not self._channel_w:
            return moved
        try:
            sent = self.channel.send(self._up_out)
        except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
            self._channel_w = False
            return moved
        except (OSError, ssl.SSLError) as exc:
            raise _ChannelError(str(exc) or type(exc).__name__) from None
        if sent < len(self._up_out):
            self._up_out = self._up_out[sent:]
            return True
        self._up_out = None
        self.up_done = self._up_last
        return True

    def _step_down(self) -> bool:
        """Decrypt what has arrived, or pass on what was decrypted; whether anything moved."""
        if self.down_done:
            return False
        if self._down_pos < self._down_fill:
            return self._deliver()
        if self._down_eof:
            raise _ChannelError("it ended in the middle of the connection")
        if not self._channel_r:
            return False
        self._down_fill = self._down_pos = 0
        channel, down = self.channel, self._down
        while self._down_fill < len(down):
            try:
                got = channel.recv_into(down[self._down_fill :])
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                self._channel_r = False
                break
            except (OSError, ssl.SSLError) as exc:
                raise _ChannelError(str(exc) or type(exc).__name__) from None
            if not got:
                self._down_eof = True
                break
            self._down_fill += got
            # A full record is bulk: more likely follows, and reading on costs at most
            # one exception per buffer. After a short one (a small message) ask the
            # kernel first: that exception would come at every hop.
            if got < _FULL_RECORD and not channel.pending() and not _unread(channel):
                self._channel_r = False  # drained; poll says when more comes
                break
        if not self._down_fill:
            if self._down_eof:
                raise _ChannelError("it ended in the middle of the connection")
            return False
        self._deliver()
        return True

    def _deliver(self) -> bool:
        """Parse the pieces in the buffer and send their bytes to the local socket, as
        far as it takes them; whether anything moved."""
        moved = False
        view, fill = self._down, self._down_fill
        while self._down_pos < fill:
            if self._left:
                if not self._local_w:
                    return moved
                end = self._down_pos + min(self._left, fill - self._down_pos)
                try:
                    sent = self.local.send(view[self._down_pos : end])
                except (BlockingIOError, InterruptedError):
                    self._local_w = False
                    return moved
                except OSError as exc:
                    raise _SocketError(exc.strerror or str(exc)) from None
                if sent < end - self._down_pos:
                    self._local_w = False  # its buffer is full; poll says when it drains
                self._down_pos += sent
                self._left -= sent
                moved = True
                continue
            take = min(_PIECE.size - len(self._header), fill - self._down_pos)
            self._header += view[self._down_pos : self._down_pos + take]
            self._down_pos += take
            moved = True
            if len(self._header) < _PIECE.size:
                break
            (self._left,) = _PIECE.unpack(self._header)
            self._header.clear()
            if self._left > CHANNEL_CHUNK:
                raise _ChannelError(f"a piece of {self._left} bytes, over {CHANNEL_CHUNK}")
            if not self._left:  # the far side's half-close; nothing may follow
                if self._down_pos < fill:
                    raise _ChannelError("bytes followed the end of the connection")
                with contextlib.suppress(OSError):
                    self.local.shutdown(socket.SHUT_WR)
                self.down_done = True
                return True
        return moved


_COUNT = struct.Struct("i")
_FULL_RECORD = 16384
"""The most bytes one TLS record carries."""


def _unread(sock: socket.socket) -> bool:
    """Whether the kernel holds bytes not yet read from ``sock`` (True where it cannot
    say: the next read finds out, at the cost of an exception)."""
    if _FIONREAD is None:
        return True
    try:
        raw = fcntl.ioctl(sock.fileno(), _FIONREAD, b"\0\0\0\0")
    except OSError:
        return True
    return bool(_COUNT.unpack(raw)[0])


_BROKEN = select.POLLERR | select.POLLHUP | select.POLLNVAL if _HAS_POLL else 0


class _Poller:
    """Wait until the wake socket, the local socket or the channel is ready: ``poll``
    where the system has it (one call, no registration per wait), else ``select``."""

    def __init__(self, wake: socket.socket, local: socket.socket, channel: socket.socket) -> None:
        self._wake, self._local, self._channel = wake.fileno(), local.fileno(), channel.fileno()
        self._poll = select.poll() if _HAS_POLL else None
        self._masks: dict[int, int] = {}
        self._last = (0, 0)
        """What the last wait wanted of (the local socket, the channel)."""
        if self._poll is not None:
            self._poll.register(self._wake, select.POLLIN)

    def wait(self, local: int, channel: int) -> tuple[bool, int, int]:
        """Block until something is ready: (woken, the local socket's readiness, the
        channel's), each ``_READ | _WRITE``; an error or hang-up counts as both, so
        the next step finds out what it is."""
        if self._poll is None:
            return self._select(local, channel)
        if (local, channel) != self._last:
            self._want(local, channel)
        woke, ready_local, ready_channel = False, 0, 0
        for fd, revents in self._poll.poll():
            ready = (_READ | _WRITE) if revents & _BROKEN else 0
            ready |= (_READ if revents & select.POLLIN else 0) | (
                _WRITE if revents & select.POLLOUT else 0
            )
            if fd == self._wake:
                woke = True
            elif fd == self._local:
                ready_local |= ready
            else:
                ready_channel |= ready
        return woke, ready_local, ready_channel

    def _want(self, local: int, channel: int) -> None:
        assert self._poll is not None
        self._last = (local, channel)
        for fd, wanted in ((self._local, local), (self._channel, channel)):
            mask = (select.POLLIN if wanted & _READ else 0) | (
                select.POLLOUT if wanted & _WRITE else 0
            )
            if self._masks.get(fd, 0) == mask:
                continue
            # A socket nothing is wanted of is left out: a hang-up on it (the local
            # program gone after its half-close) would wake every wait at once.
            if mask:
                self._poll.register(fd, mask)  # again: modifies
            else:
                self._poll.unregister(fd)
            self._masks[fd] = mask

    def _select(self, local: int, channel: int) -> tuple[bool, int, int]:
        pairs = ((self._local, local), (self._channel, channel))
        readers = [self._wake, *(fd for fd, wanted in pairs if wanted & _READ)]
        writers = [fd for fd, wanted in pairs if wanted & _WRITE]
        readable, writable, failed = select.select(readers, writers, [self._local, self._channel])

        def ready(fd: int) -> int:
            broken = (_READ | _WRITE) if fd in failed else 0
            return broken | (_READ if fd in readable else 0) | (_WRITE if fd in writable else 0)

        return self._wake in readable, ready(self._local), ready(self._channel)


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
