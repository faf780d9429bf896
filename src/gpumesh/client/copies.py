"""A copy's progress as an async iterator: ``async for event in watch_copy(...)``.

:func:`gpumesh.client.files.copy` reports through :class:`CopyCallbacks`; this
adapts them for callers that read events (a web route, a browser's progress
bar). Progress is coalesced (:mod:`gpumesh.client._events`): a reader slower than
the copy sees the newest count, never a backlog.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpumesh.client._events import EventQueue, Watch, stop
from gpumesh.client.files import CopyCallbacks, CopyResult, copy

if TYPE_CHECKING:
    from gpumesh.client.node import Node
    from gpumesh.errors import GPUMeshError

__all__ = ["CopyEvent", "CopyProgress", "CopyRetrying", "CopyStarted", "CopyWatch", "watch_copy"]


@dataclass(frozen=True)
class CopyStarted:
    what: str
    """What is copied, e.g. ``data.bin -> alice-pc:/data.bin``."""
    total: int


@dataclass(frozen=True)
class CopyProgress:
    done: int
    """Bytes in place so far, resumed ones included."""
    total: int


@dataclass(frozen=True)
class CopyRetrying:
    error: GPUMeshError
    """Why the link was lost."""
    attempt: int
    """The attempt about to start."""


CopyEvent = CopyStarted | CopyProgress | CopyRetrying


class CopyWatch(Watch[CopyEvent]):
    """One copy, run while it is iterated (once); ``result`` once iteration ended
    (the copy's error is raised from the loop instead)."""

    def __init__(self, node: Node, source: str, destination: str, options: dict[str, Any]) -> None:
        self.result: CopyResult | None = None
        self._events = self._run(node, source, destination, options)

    async def _run(
        self, node: Node, source: str, destination: str, options: dict[str, Any]
    ) -> AsyncGenerator[CopyEvent, None]:
        queue: EventQueue[CopyEvent] = EventQueue((CopyProgress,))
        callbacks = CopyCallbacks(
            started=lambda what, total: queue.push(CopyStarted(what, total)),
            progress=lambda done, total: queue.push(CopyProgress(done, total)),
            retrying=lambda error, attempt: queue.push(CopyRetrying(error, attempt)),
        )
        task = asyncio.ensure_future(
            copy(node, source, destination, callbacks=callbacks, **options)
        )
        try:
            while (event := await queue.next(task)) is not None:
                yield event
            self.result = task.result()
        finally:
            await stop(task)


def watch_copy(node: Node, source: str, destination: str, **options: Any) -> CopyWatch:
    """:func:`gpumesh.client.files.copy` (same arguments, less ``callbacks``) as events."""
    return CopyWatch(node, source, destination, options)
