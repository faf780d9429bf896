"""Blocking calls (the Docker SDK, NVML) from the agent's event loop.

Each call runs in its own daemon thread: a long ``wait`` or log follow must
never keep the process alive after ``share stop``, and a job's three
long-lived calls must not exhaust a small shared pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["in_thread"]

T = TypeVar("T")


def in_thread(function: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """Run a blocking call in a daemon thread; never blocks interpreter exit."""
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
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, *report)

    threading.Thread(target=target, name="gpumesh-job", daemon=True).start()
    return future
