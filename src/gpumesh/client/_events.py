"""Callbacks turned into events for ``async for``: what watch_copy and watch_run share.

An operation that reports through callbacks runs as a task; its callbacks
:meth:`EventQueue.push` events, and the reader takes them one at a time with
:meth:`EventQueue.next`. Events of a progress type are coalesced: a reader slower
than the operation sees the newest figure, never a backlog, so the operation
never waits for it and memory stays flat.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Generic, TypeVar

__all__ = ["EventQueue", "Watch", "stop"]

E = TypeVar("E")


class Watch(Generic[E]):
    """An operation's events, read with ``async for`` (once). Leaving the loop early:
    call :meth:`aclose` (or use ``contextlib.aclosing``)."""

    _events: AsyncGenerator[E, None]

    def __aiter__(self) -> AsyncIterator[E]:
        return self._events

    async def aclose(self) -> None:
        """Stop reading; what still runs for the reader is cancelled."""
        await self._events.aclose()


class EventQueue(Generic[E]):
    def __init__(self, progress: tuple[type[Any], ...]) -> None:
        self._progress = progress
        self._pending: deque[E] = deque()
        self._wake = asyncio.Event()

    def push(self, event: E) -> None:
        last = self._pending[-1] if self._pending else None
        if isinstance(event, self._progress) and type(last) is type(event):
            self._pending[-1] = event
        else:
            self._pending.append(event)
        self._wake.set()

    async def next(self, task: asyncio.Future[Any]) -> E | None:
        """The next event; None once ``task`` ended and every event was taken."""
        while not self._pending:
            if task.done():
                return None
            self._wake.clear()
            waiter = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
        return self._pending.popleft()


async def stop(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` unless it ended (a reader left early), and wait for it."""
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
