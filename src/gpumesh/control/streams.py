"""Server-Sent Events of the control API: one event's bytes (:func:`sse`), a
response that stops its source when the client leaves (:class:`EventStream`),
keep-alives in a quiet stream (:func:`paced`, :func:`paced_events`) and a feed a task puts events in
(:class:`Feed`, :func:`feed_events`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gpumesh.client.views import ErrorView
from gpumesh.errors import GPUMeshError

__all__ = [
    "KEEPALIVE",
    "KEEP_ALIVE",
    "EventStream",
    "Feed",
    "feed_events",
    "paced",
    "paced_events",
    "sse",
]


KEEPALIVE = 15.0
"""Seconds of silence after which an event stream sends a comment, so a client
that left is noticed and a proxy keeps the stream open."""


KEEP_ALIVE = object()
"""What :func:`paced` yields when its source was silent for :data:`KEEPALIVE` seconds."""


async def paced(source: Any) -> AsyncGenerator[Any, None]:
    """``source``'s events, with :data:`KEEP_ALIVE` after every :data:`KEEPALIVE`
    seconds of silence (a long sync or a quiet job), so proxies and browsers keep
    the stream open; closing this closes ``source``."""
    it = aiter(source)
    pending: asyncio.Future[Any] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({pending}, timeout=KEEPALIVE)
            if not done:
                yield KEEP_ALIVE
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            finally:
                if pending.done():
                    pending = None
            yield event
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        await source.aclose()


async def paced_events(
    source: Any, event: Callable[[Any], bytes], end: Callable[[], bytes]
) -> AsyncIterator[bytes]:
    """``source``'s events through :func:`paced`, each as ``event`` makes it, a
    keep-alive comment in each silence, then ``end()``, or an ``error`` event."""
    events = paced(source)
    try:
        async for item in events:
            yield b": keep-alive\n\n" if item is KEEP_ALIVE else event(item)
        yield end()
    except GPUMeshError as exc:
        yield sse("error", ErrorView(exc.code, exc.message))
    finally:
        await events.aclose()


def sse(event: str, data: object, event_id: int | None = None) -> bytes:
    """One Server-Sent Event: its name, id (when it has one) and JSON data on one line."""
    head = f"event: {event}\n" + ("" if event_id is None else f"id: {event_id}\n")
    return head.encode() + b"data: " + msgspec.json.encode(data, enc_hook=str) + b"\n\n"


class Feed:
    """What a long call reports while it runs, for :func:`feed_events`: named
    events in order; a ``latest`` one replaces one of its name not yet sent (a
    progress figure the client has not seen need not be sent)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, object]] = []
        self.ready = asyncio.Event()

    def put(self, name: str, data: object, *, latest: bool = False) -> None:
        if latest and self.items and self.items[-1][0] == name:
            self.items[-1] = (name, data)
        else:
            self.items.append((name, data))
        self.ready.set()


async def feed_events(work: Callable[[Feed], Awaitable[object]]) -> AsyncIterator[bytes]:
    """Server-Sent Events of ``work``: what it puts in its feed, then ``end`` with
    what it returns, or ``error``. The stream's end (the client left) cancels it."""
    feed = Feed()
    task = asyncio.ensure_future(work(feed))
    try:
        while True:
            waiter = asyncio.ensure_future(feed.ready.wait())
            try:
                done, _ = await asyncio.wait(
                    {task, waiter}, timeout=KEEPALIVE, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                waiter.cancel()
            finished = task.done()
            feed.ready.clear()
            items, feed.items = feed.items, []
            for name, data in items:
                yield sse(name, data)
            if finished:
                break
            if not done:
                yield b": keep-alive\n\n"
        yield sse("end", task.result())
    except GPUMeshError as exc:
        yield sse("error", ErrorView(exc.code, exc.message))
    finally:
        task.cancel()  # nothing to a task already done
        with contextlib.suppress(BaseException):
            await task


class EventStream(Response):
    """A ``text/event-stream`` response that stops its source as soon as the client
    leaves (an idle follow notices through the keep-alive comments too)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        super().__init__(
            headers={"cache-control": "no-store", "x-accel-buffering": "no"},
            media_type=self.media_type,
        )
        # A stream has no length; the rest of the headers stay Starlette's.
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self._events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        tasks = [asyncio.ensure_future(stream()), asyncio.ensure_future(disconnected())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if tasks[0] in done:
                tasks[0].result()
        except OSError:
            pass  # the client left while we wrote
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()
