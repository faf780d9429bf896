"""transport/stream: what a stream holds counts on its link, and a link's buffer limit
ends the stream that would go over it. Without sockets: the link is a stand-in."""

from __future__ import annotations

import asyncio

import pytest

from gpumesh.errors import ConnectionLostError, LimitError
from gpumesh.protocol.framing import FrameKind, encode_frame, encode_header
from gpumesh.protocol.messages import Ping, Refusal, decode_message, encode_message
from gpumesh.transport.stream import RESET_OVER_LIMIT, Stream


class FakeLink:
    """What a Stream asks of its QuicLink; sent bytes stay "unsent" until taken."""

    def __init__(self, limit: int = 0) -> None:
        self.buffer_limit = limit
        self.is_closed = False
        self.unread = 0
        self.unsent = 0
        self.sent: list[tuple[bytes, bool]] = []
        self.resets: list[tuple[int, int]] = []
        self.stopped: list[int] = []

    def note_unread(self, delta: int) -> None:
        self.unread += delta

    def held(self) -> int:
        return self.unread + self.unsent

    def send(self, stream_id: int, data: bytes | memoryview, end_stream: bool = False) -> None:
        self.sent.append((bytes(data), end_stream))
        self.unsent += len(data)

    def send_buffer_size(self, stream_id: int) -> int:
        return 0

    async def wait_writable(self, stream_id: int) -> None:
        return None

    def reset_stream(self, stream_id: int, code: int = 0) -> None:
        self.resets.append((stream_id, code))

    def stop_receiving(self, stream_id: int) -> None:
        self.stopped.append(stream_id)


def _stream(link: FakeLink) -> Stream:
    return Stream(link, 4)  # type: ignore[arg-type]


def _message(message: Ping) -> bytes:
    return encode_frame(FrameKind.MESSAGE, encode_message(message))


def _data(size: int) -> bytes:
    return encode_header(FrameKind.DATA, size) + b"d" * size


def test_what_a_stream_holds_counts_on_its_link_until_read_or_forgotten() -> None:
    async def scenario() -> None:
        link = FakeLink()
        stream = _stream(link)
        ping = _message(Ping(sent=1.0))
        stream.feed(ping + _data(1000) + _data(3)[:4], end_stream=False)  # and a partial header
        body = len(ping) - 5
        assert stream.held == link.unread == body + 1000 + 4
        assert isinstance(decode_message((await stream.read_frame()).body), Ping)  # type: ignore[union-attr]
        assert stream.held == link.unread == 1000 + 4
        assert await stream.read_data() == b"d" * 1000
        assert stream.held == link.unread == 4
        stream.uncount()  # the link forgot it
        assert link.unread == 0
        stream.feed(_data(3)[4:], end_stream=False)
        assert stream.held == 3 and link.unread == 0

    asyncio.run(scenario())


def test_a_stream_that_takes_its_link_over_the_limit_is_refused_and_its_bytes_dropped() -> None:
    async def scenario() -> None:
        link = FakeLink(limit=10_000)
        link.unread = 6_000  # what other streams of the link hold
        stream = _stream(link)
        stream.feed(_data(3_000), end_stream=False)
        assert link.sent == [] and stream.held == 3_000
        stream.feed(_data(2_000), end_stream=False)
        # Dropped, refused with the numbers, and the peer asked to stop sending.
        assert stream.held == 0 and link.unread == 6_000
        (frame, end), *_ = link.sent
        refusal = decode_message(frame[5:])
        assert isinstance(refusal, Refusal) and end
        assert refusal.code == "limit"
        assert refusal.message == (
            "the provider ended this request: your connection took it to 11KB of unread "
            "requests and unsent replies, over its link_buffer of 10KB; read replies as they "
            "come and send no more than is read"
        )
        assert link.stopped == [4]
        assert isinstance(await stream.wait_failed(), LimitError)
        with pytest.raises(LimitError, match="link_buffer of 10KB"):
            await stream.read_frame()
        with pytest.raises(LimitError):
            stream.send_message(Ping(sent=2.0))
        stream.feed(_data(5_000), end_stream=False)  # what still comes is dropped
        assert stream.held == 0 and link.unread == 6_000
        assert len(link.sent) == 1  # refused once

    asyncio.run(scenario())


def test_a_reply_that_would_take_the_link_over_the_limit_resets_the_stream() -> None:
    async def scenario() -> None:
        link = FakeLink(limit=100_000)
        stream = _stream(link)
        await stream.send_data(b"x" * 60_000)
        link.unsent = 90_000  # the peer takes nothing
        with pytest.raises(LimitError, match=r"link_buffer allows \(.*over its link_buffer"):
            await stream.send_data(b"x" * 20_000)
        assert link.resets == [(4, RESET_OVER_LIMIT)]  # QUIC drops what it queued for it
        assert isinstance(await stream.wait_failed(), LimitError)
        with pytest.raises(LimitError):
            stream.send_message(Ping(sent=1.0))
        stream.finish()  # nothing follows a reset, not even a FIN
        stream.refuse(LimitError("x"))
        assert link.unsent == 90_000

    asyncio.run(scenario())


def test_without_a_limit_nothing_is_refused() -> None:
    async def scenario() -> None:
        link = FakeLink(limit=0)
        stream = _stream(link)
        for _ in range(8):
            stream.feed(_data(1_000_000), end_stream=False)
        await stream.send_data(b"x" * 3_000_000)
        assert stream.held == 8_000_000 and not link.resets and not link.stopped

    asyncio.run(scenario())


def test_a_peer_that_stops_reading_ends_our_writes_not_our_reads() -> None:
    async def scenario() -> None:
        link = FakeLink()
        stream = _stream(link)
        stream.feed(_message(Ping(sent=1.0)), end_stream=False)
        stream.stop_sending()
        assert isinstance(await stream.wait_failed(), ConnectionLostError)
        assert isinstance(await stream.read_message(), Ping)
        with pytest.raises(ConnectionLostError, match="stopped reading"):
            await stream.send_data(b"x")
        with pytest.raises(ConnectionLostError, match="stopped reading"):
            stream.send_message(Ping(sent=2.0))
        stream.refuse(LimitError("x"))  # QUIC reset our side: nothing may be written
        assert link.sent == []

    asyncio.run(scenario())
