"""The pieces that carry `cp`, `app run` and `exec` through the node process:
a long call's events (`feed_events`) and a shell's frames."""

from __future__ import annotations

import asyncio

import pytest

from gpumesh.control.streams import Feed, feed_events
from gpumesh.daemon import frames
from gpumesh.errors import NotFoundError


def test_a_feed_streams_in_order_coalesces_progress_and_ends_with_the_result() -> None:
    async def work(feed: Feed) -> object:
        feed.put("copystarted", {"label": "a -> b"})
        for done in (1, 2, 3):
            feed.put("copyprogress", {"done": done}, latest=True)
        feed.put("copyretrying", {"attempt": 2})
        return {"size": 3}

    async def read() -> list[bytes]:
        return [chunk async for chunk in feed_events(work)]

    chunks = asyncio.run(read())
    assert chunks == [
        b'event: copystarted\ndata: {"label":"a -> b"}\n\n',
        b'event: copyprogress\ndata: {"done":3}\n\n',  # only the newest figure unsent
        b'event: copyretrying\ndata: {"attempt":2}\n\n',
        b'event: end\ndata: {"size":3}\n\n',
    ]


def test_a_feed_ends_with_the_errors_code_and_message() -> None:
    async def work(feed: Feed) -> object:
        raise NotFoundError("no such file /x: copy it there first")

    async def read() -> list[bytes]:
        return [chunk async for chunk in feed_events(work)]

    (last,) = asyncio.run(read())
    assert last.startswith(b"event: error\ndata: ")
    assert b'"message":"no such file /x: copy it there first"' in last


def test_leaving_a_feeds_stream_cancels_its_work() -> None:
    """The CLI's Ctrl-C ends the stream: the copy under way stops there."""
    cancelled = asyncio.Event()

    async def work(feed: Feed) -> object:
        feed.put("copystarted", {"label": "big"})
        try:
            await asyncio.Event().wait()  # a copy that would go on
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return None

    async def leave_after_one() -> bool:
        stream = feed_events(work)
        first = await anext(stream)
        assert first.startswith(b"event: copystarted")
        await stream.aclose()
        return cancelled.is_set()

    assert asyncio.run(leave_after_one())


def test_frames_round_trip_and_a_bad_one_is_refused() -> None:
    async def parse(data: bytes) -> list[tuple[bytes, bytes] | None]:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        found: list[tuple[bytes, bytes] | None] = []
        while (item := await frames.read_frame(reader)) is not None:
            found.append(item)
        return found

    data = frames.frame(frames.TOKEN, b"t0k") + frames.resize_frame(40, 120)
    data += frames.frame(frames.DATA, b"\x03ls\r") + frames.frame(frames.EOF)
    items = asyncio.run(parse(data))
    assert items == [
        (frames.TOKEN, b"t0k"),
        (frames.RESIZE, frames.resize_frame(40, 120)[5:]),
        (frames.DATA, b"\x03ls\r"),
        (frames.EOF, b""),
    ]
    resize = items[1]
    assert resize is not None and frames.resize_of(resize[1]) == (40, 120)
    with pytest.raises(frames.FrameError):
        asyncio.run(parse(frames.frame(frames.DATA, b"abc")[:-1]))  # cut inside a frame
    too_big = b"D" + (frames.MAX_FRAME + 1).to_bytes(4, "big")
    with pytest.raises(frames.FrameError):
        asyncio.run(parse(too_big))
