"""One request's stream: typed messages and flow-controlled bulk data.

A :class:`Stream` turns the byte stream of a QUIC stream into frames
(:mod:`gpumesh.protocol.framing`) and back. Bulk data is sent only within the
receiver's credit (:mod:`gpumesh.protocol.flow`) and while QUIC's own send
queue for the stream is short, so neither side buffers without bound.

On a link with a buffer limit (the provider's, ``link_buffer``), a stream
that would take the link's held bytes (unread frames of all its streams, and
what QUIC has not sent yet) over it is ended: one that received too much is
refused with the numbers and its unread bytes dropped, one whose replies the
peer does not take is reset with :data:`RESET_OVER_LIMIT`.
"""

from __future__ import annotations

import asyncio
import struct
from collections import deque
from typing import Protocol, TypeVar

from gpumesh.errors import (
    ConnectionLostError,
    GPUMeshError,
    LimitError,
    ProtocolError,
    error_from_code,
)
from gpumesh.protocol.flow import ReceiveWindow, SendWindow
from gpumesh.protocol.framing import (
    HEADER_SIZE,
    Frame,
    FrameDecoder,
    FrameKind,
    encode_frame,
    encode_header,
)
from gpumesh.protocol.messages import Message, Refusal, decode_message, encode_message
from gpumesh.units import format_size

__all__ = ["DATA_CHUNK", "RESET_OVER_LIMIT", "Stream", "StreamLink", "over_limit_error"]

DATA_CHUNK = 256 * 1024
"""Bulk bytes per DATA frame when sending."""
_MAX_QUEUED_CONTROL = 256 * 1024
"""Most non-bulk frame bytes a peer may make us hold unread on one stream."""
RESET_OVER_LIMIT = 0x101
"""Application error code of a stream reset because its peer did not take its data
while the link held more than its buffer limit; the peer raises it as a LimitError."""

M = TypeVar("M")


class StreamLink(Protocol):
    """What a stream needs of the connection it runs on (a
    :class:`~gpumesh.transport.quic.QuicLink`): defined here, so that streams know
    nothing of QUIC and the link's module is the only one that imports the other."""

    @property
    def buffer_limit(self) -> int:
        """Most bytes the link may hold before a stream that adds to them is ended; 0: none."""
        ...

    @property
    def is_closed(self) -> bool: ...

    def held(self) -> int:
        """Bytes the link holds now: unread by handlers and not yet sent."""
        ...

    def note_unread(self, delta: int) -> None: ...

    def send(self, stream_id: int, data: bytes | memoryview, end_stream: bool = False) -> None: ...

    def send_buffer_size(self, stream_id: int | None = None) -> int: ...

    async def wait_writable(self, stream_id: int) -> None: ...

    def reset_stream(self, stream_id: int, code: int = 0) -> None: ...

    def stop_receiving(self, stream_id: int) -> None:
        """Ask the peer to stop sending on the stream."""
        ...


class Stream:
    """A bidirectional stream of one request on a link (:class:`StreamLink`)."""

    def __init__(self, link: StreamLink, stream_id: int) -> None:
        self.link = link
        self.stream_id = stream_id
        self._decoder = FrameDecoder()
        self._frames: deque[Frame] = deque()
        self._queued_control = 0
        self._readable = asyncio.Event()
        self._credit_event = asyncio.Event()
        self._eof = False
        self._error: GPUMeshError | None = None
        self._finished = False
        self._send_window = SendWindow()
        self._receive_window = ReceiveWindow()
        self._queued = 0
        """Body bytes of the frames in ``_frames``."""
        self._held = 0
        """What this stream holds for its reader: queued frames and a partial one."""
        self._counted = True
        """Whether ``_held`` is part of the link's total (until the link forgets us)."""
        self._send_error: GPUMeshError | None = None
        """Why nothing more may be written (over its link's limit, the peer stopped
        reading, our side reset): writes raise it."""
        self._failed = asyncio.Event()

    # --- receive side (called by the link) -----------------------------------------

    def feed(self, data: bytes, end_stream: bool) -> None:
        if self._error is not None:
            return
        try:
            for frame in self._decoder.feed(data):
                if frame.kind is FrameKind.CREDIT:
                    (consumed,) = struct.unpack("!Q", frame.body)
                    self._send_window.on_credit(consumed)
                    self._credit_event.set()
                    continue
                if frame.kind is FrameKind.DATA:
                    self._receive_window.on_received(len(frame.body))
                else:
                    self._queued_control += len(frame.body)
                    if self._queued_control > _MAX_QUEUED_CONTROL:
                        raise ProtocolError("peer sent too many messages without waiting")
                self._frames.append(frame)
                self._queued += len(frame.body)
            if end_stream:
                if not self._decoder.at_frame_boundary():
                    raise ProtocolError("peer ended the stream in the middle of a frame")
                self._eof = True
        except GPUMeshError as exc:
            self._error = exc
            self._failed.set()
        self._count_held()
        limit = self.link.buffer_limit
        if limit and self._held and (held := self.link.held()) > limit:
            self._refuse_over_limit(held, limit)
        self._readable.set()

    def fail(self, error: GPUMeshError) -> None:
        if self._error is None:
            self._error = error
        self._readable.set()
        self._credit_event.set()
        self._failed.set()

    async def wait_failed(self) -> GPUMeshError:
        """Wait until the stream failed (reset or stopped by the peer, its link closed,
        over its limits, a malformed frame); returns why."""
        await self._failed.wait()
        error = self._error or self._send_error
        assert error is not None
        return error

    # --- what the stream holds ----------------------------------------------------------

    @property
    def held(self) -> int:
        """Bytes received and not yet read: queued frames and a partial one."""
        return self._held

    def _count_held(self) -> None:
        held = self._queued + self._decoder.buffered
        if self._counted:
            self.link.note_unread(held - self._held)
        self._held = held

    def uncount(self) -> None:
        """The link forgot this stream: what it still holds no longer counts there."""
        if self._counted:
            self._counted = False
            self.link.note_unread(-self._held)

    def _refuse_over_limit(self, held: int, limit: int) -> None:
        """This stream's data took the link over its limit: drop what it holds unread,
        refuse it with the numbers, and ask the peer to stop sending on it."""
        error = LimitError(
            f"the provider ended this request: your connection took it to "
            f"{format_size(held)} of unread requests and unsent replies, over its "
            f"link_buffer of {format_size(limit)}; read replies as they come and send no "
            "more than is read"
        )
        self._frames.clear()
        self._queued = self._queued_control = 0
        self._decoder = FrameDecoder()
        self._count_held()
        self.refuse(error)
        self.link.stop_receiving(self.stream_id)
        self._error = self._send_error = error
        self._failed.set()
        self._credit_event.set()

    def _room_for(self, size: int) -> None:
        """Before queueing ``size`` bytes to send: raise when the stream went over its
        link's limit, or would take it there now (then reset, so what it queued is freed)."""
        if self._send_error is not None:
            raise self._send_error
        limit = self.link.buffer_limit
        if not limit:
            return
        held = self.link.held()
        if held + size <= limit:
            return
        error = over_limit_error(
            f"{format_size(held + size)}, over its link_buffer of {format_size(limit)}"
        )
        self._send_error = error
        if self._error is None:
            self._error = error
        self._failed.set()
        self._credit_event.set()
        self._readable.set()
        self.abort(RESET_OVER_LIMIT)
        raise error

    def stop_sending(self) -> None:
        """The peer will not read what we send (QUIC STOP_SENDING); what it sent us,
        a refusal perhaps, can still be read."""
        if self._send_error is None:
            self._send_error = ConnectionLostError("the peer stopped reading this request")
        self._credit_event.set()
        self._failed.set()

    # --- reading ----------------------------------------------------------------------

    async def read_frame(self) -> Frame | None:
        """The next frame, or None when the peer finished the stream.

        A DATA frame counts as consumed once it is handed out here: its bytes
        go back to the sender as credit.
        """
        while True:
            if self._frames:
                frame = self._frames.popleft()
                self._queued -= len(frame.body)
                self._count_held()
                if frame.kind is FrameKind.MESSAGE:
                    self._queued_control -= len(frame.body)
                elif frame.body:
                    self._release(len(frame.body))
                return frame
            if self._error is not None:
                raise self._error
            if self._eof:
                return None
            self._readable.clear()
            await self._readable.wait()

    async def read_message(self) -> Message:
        """The next message; a Refusal from the peer is raised as its error."""
        frame = await self.read_frame()
        if frame is None:
            raise ConnectionLostError("the peer closed the request without answering")
        if frame.kind is not FrameKind.MESSAGE:
            raise ProtocolError("peer sent data where a message was expected")
        message = decode_message(frame.body)
        if isinstance(message, Refusal):
            raise error_from_code(message.code, message.message)
        return message

    async def expect(self, kind: type[M]) -> M:
        message = await self.read_message()
        if not isinstance(message, kind):
            raise ProtocolError(
                f"peer sent {type(message).__name__} where {kind.__name__} was expected"
            )
        return message

    async def read_data(self) -> bytes:
        """The next chunk of a bulk section; ``b""`` marks its end."""
        frame = await self.read_frame()
        if frame is None:
            raise ConnectionLostError("the peer closed the stream in the middle of a transfer")
        if frame.kind is FrameKind.MESSAGE:
            message = decode_message(frame.body)
            if isinstance(message, Refusal):
                raise error_from_code(message.code, message.message)
            raise ProtocolError("peer sent a message in the middle of a transfer")
        return frame.body

    def _release(self, count: int) -> None:
        credit = self._receive_window.on_consumed(count)
        if (
            credit is not None
            and not self._finished
            and self._send_error is None  # our side is reset: no frame may follow
            and not self.link.is_closed
        ):
            self.link.send(
                self.stream_id, encode_frame(FrameKind.CREDIT, struct.pack("!Q", credit))
            )

    # --- writing ----------------------------------------------------------------------

    def send_message(self, message: Message, *, end: bool = False) -> None:
        frame = encode_frame(FrameKind.MESSAGE, encode_message(message))
        self._room_for(len(frame))
        self.link.send(self.stream_id, frame, end)
        if end:
            self._finished = True

    def refuse(self, error: GPUMeshError) -> None:
        """Answer with a typed refusal and end our side of the stream."""
        if self._finished or self._send_error is not None or self.link.is_closed:
            return
        refusal = Refusal(code=error.code, message=error.message[:2048])
        # Past any buffer limit: a refusal is small, and it ends the stream.
        self.link.send(
            self.stream_id, encode_frame(FrameKind.MESSAGE, encode_message(refusal)), True
        )
        self._finished = True

    async def send_data(self, data: bytes | memoryview) -> None:
        """Send bulk bytes, waiting for the peer's credit and our send queue."""
        view = memoryview(data)
        while view:
            if (error := self._error or self._send_error) is not None:
                raise error
            available = self._send_window.available()
            if available == 0:
                self._credit_event.clear()
                await self._credit_event.wait()
                continue
            chunk = view[: min(DATA_CHUNK, available)]
            self._room_for(len(chunk) + HEADER_SIZE)
            self.link.send(self.stream_id, encode_header(FrameKind.DATA, len(chunk)))
            self.link.send(self.stream_id, chunk)
            self._send_window.on_sent(len(chunk))
            view = view[len(chunk) :]
            if self.link.send_buffer_size(self.stream_id) > 0:
                await self.link.wait_writable(self.stream_id)

    async def drain(self) -> None:
        """Wait while too much of what we sent is still queued in QUIC."""
        await self.link.wait_writable(self.stream_id)

    def end_data(self) -> None:
        """Mark the end of a bulk section."""
        self._room_for(HEADER_SIZE)
        self.link.send(self.stream_id, encode_header(FrameKind.DATA, 0))

    def finish(self) -> None:
        """End our side of the stream (QUIC FIN)."""
        if not self._finished and self._send_error is None and not self.link.is_closed:
            self._finished = True
            self.link.send(self.stream_id, b"", end_stream=True)

    def abort(self, code: int = 0) -> None:
        """Reset our side: what QUIC still holds of it is dropped, and nothing follows."""
        self._finished = True
        if self._send_error is None:
            self._send_error = self._error or ConnectionLostError("this request was abandoned")
        self.link.reset_stream(self.stream_id, code)


def over_limit_error(numbers: str = "") -> LimitError:
    """What a stream reset with :data:`RESET_OVER_LIMIT` means (the provider's side
    gives the numbers; a reset carries none)."""
    held = f" ({numbers})" if numbers else ""
    return LimitError(
        "the provider ended this request: it held more of your connection's unsent "
        f"replies than its link_buffer allows{held}; read replies as they come"
    )
