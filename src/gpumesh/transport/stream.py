"""One request's stream: typed messages and flow-controlled bulk data.

A :class:`Stream` turns the byte stream of a QUIC stream into frames
(:mod:`gpumesh.protocol.framing`) and back. Bulk data is sent only within the
receiver's credit (:mod:`gpumesh.protocol.flow`) and while QUIC's own send
queue for the stream is short, so neither side buffers without bound.
"""

from __future__ import annotations

import asyncio
import struct
from collections import deque
from typing import TYPE_CHECKING, TypeVar

from gpumesh.errors import ConnectionLostError, GPUMeshError, ProtocolError, error_from_code
from gpumesh.protocol.flow import ReceiveWindow, SendWindow
from gpumesh.protocol.framing import Frame, FrameDecoder, FrameKind, encode_frame, encode_header
from gpumesh.protocol.messages import Message, Refusal, decode_message, encode_message

if TYPE_CHECKING:
    from gpumesh.transport.quic import QuicLink

__all__ = ["DATA_CHUNK", "Stream"]

DATA_CHUNK = 256 * 1024
"""Bulk bytes per DATA frame when sending."""
_MAX_QUEUED_CONTROL = 256 * 1024
"""Most non-bulk frame bytes a peer may make us hold unread on one stream."""

M = TypeVar("M")


class Stream:
    """A bidirectional stream of one request on a :class:`QuicLink`."""

    def __init__(self, link: QuicLink, stream_id: int) -> None:
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
            if end_stream:
                if not self._decoder.at_frame_boundary():
                    raise ProtocolError("peer ended the stream in the middle of a frame")
                self._eof = True
        except GPUMeshError as exc:
            self._error = exc
        self._readable.set()

    def fail(self, error: GPUMeshError) -> None:
        if self._error is None:
            self._error = error
        self._readable.set()
        self._credit_event.set()

    def stop_sending(self) -> None:
        self.fail(ConnectionLostError("the peer stopped reading this request"))

    # --- reading ----------------------------------------------------------------------

    async def read_frame(self) -> Frame | None:
        """The next frame, or None when the peer finished the stream.

        A DATA frame counts as consumed once it is handed out here: its bytes
        go back to the sender as credit.
        """
        while True:
            if self._frames:
                frame = self._frames.popleft()
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
        if credit is not None and not self._finished and not self.link.is_closed:
            self.link.send(
                self.stream_id, encode_frame(FrameKind.CREDIT, struct.pack("!Q", credit))
            )

    # --- writing ----------------------------------------------------------------------

    def send_message(self, message: Message, *, end: bool = False) -> None:
        self.link.send(
            self.stream_id, encode_frame(FrameKind.MESSAGE, encode_message(message)), end
        )
        if end:
            self._finished = True

    def refuse(self, error: GPUMeshError) -> None:
        """Answer with a typed refusal and end our side of the stream."""
        if self._finished or self.link.is_closed:
            return
        self.send_message(Refusal(code=error.code, message=error.message[:2048]), end=True)

    async def send_data(self, data: bytes | memoryview) -> None:
        """Send bulk bytes, waiting for the peer's credit and our send queue."""
        view = memoryview(data)
        while view:
            if self._error is not None:
                raise self._error
            available = self._send_window.available()
            if available == 0:
                self._credit_event.clear()
                await self._credit_event.wait()
                continue
            chunk = view[: min(DATA_CHUNK, available)]
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
        self.link.send(self.stream_id, encode_header(FrameKind.DATA, 0))

    def finish(self) -> None:
        """End our side of the stream (QUIC FIN)."""
        if not self._finished and not self.link.is_closed:
            self._finished = True
            self.link.send(self.stream_id, b"", end_stream=True)

    def abort(self) -> None:
        self._finished = True
        self.link.reset_stream(self.stream_id)
