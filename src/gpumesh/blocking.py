"""Blocking calls (the Docker SDK, NVML) from the agent's event loop.

Each call runs in its own daemon thread: a long ``wait`` or log follow must
never keep the process alive after ``share stop``, and a job's three
long-lived calls must not exhaust a small shared pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, TypeVar

from gpumesh import platform

__all__ = ["abandon", "closing_in_thread", "in_thread", "run_async"]

T = TypeVar("T")


class _Closeable(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=_Closeable)


def in_thread(
    function: Callable[..., T], *args: Any, orphaned: Callable[[T], None] | None = None
) -> asyncio.Future[T]:
    """Run a blocking call in a daemon thread; never blocks interpreter exit.
    ``orphaned`` gets the call's result when its loop closed before it returned
    (nobody can take it then)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def target() -> None:
        try:
            result = function(*args)
        except BaseException as exc:
            report: tuple[T | None, BaseException | None] = (None, exc)
        else:
            report = (result, None)
        # The loop may be gone (the agent stopped while this call blocked): then
        # nobody waits for the answer, and the container is re-attached next start.
        try:
            loop.call_soon_threadsafe(settle, *report)
        except RuntimeError:
            if orphaned is not None and report[1] is None:
                orphaned(report[0])  # type: ignore[arg-type]

    threading.Thread(target=target, name="gpumesh-job", daemon=True).start()
    return future


def abandon(future: asyncio.Future[Any]) -> None:
    """Let go of an :func:`in_thread` call nobody will await any more: cancelled
    while it runs (what it returns or raises later is dropped), its error taken
    as seen when it already failed (else asyncio prints "Future exception was
    never retrieved", with a traceback, when the future is collected)."""
    if not future.done():
        future.cancel()
    elif not future.cancelled():
        future.exception()


async def closing_in_thread(function: Callable[..., C], *args: Any) -> C:
    """:func:`in_thread` for a call that returns something to close (a socket, a
    channel): when the caller is cancelled before the call returns, or its loop
    closed meanwhile, what it returns later is closed instead of left to the
    garbage collector."""
    future = in_thread(function, *args, orphaned=_close)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        future.add_done_callback(_close_unclaimed)
        raise


def _close_unclaimed(future: asyncio.Future[C]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().close()


def _close(thing: C) -> None:
    with contextlib.suppress(OSError):
        thing.close()


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run``, on a loop that can watch sockets: Windows' default
    (Proactor) loop cannot, its selector loop can (though not pipes or a console)."""
    if platform.has("add_reader"):
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        return runner.run(coro)
