"""closing_in_thread: what a blocking call returns after its caller gave up is closed."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from gpumesh.blocking import closing_in_thread


class Thing:
    def __init__(self) -> None:
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()


def test_a_result_that_arrives_after_the_caller_was_cancelled_is_closed() -> None:
    release = threading.Event()
    thing = Thing()

    def blocking() -> Thing:
        release.wait(30)
        return thing

    async def scenario() -> None:
        waiter = asyncio.ensure_future(closing_in_thread(blocking))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiter
        assert not thing.closed.is_set()
        release.set()  # the call returns only now: nobody takes its result
        for _ in range(3000):
            if thing.closed.is_set():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the unclaimed result was never closed")

    asyncio.run(scenario())


def test_a_result_taken_in_time_is_left_open() -> None:
    thing = Thing()

    async def scenario() -> Thing:
        return await closing_in_thread(lambda: thing)

    assert asyncio.run(scenario()) is thing
    assert not thing.closed.is_set()


def test_a_result_that_arrives_after_the_loop_closed_is_closed() -> None:
    """The loop is gone (a command ended, an agent stopped) while the call blocked:
    nobody can take what it returns, so it is closed where it arrives."""
    release = threading.Event()
    started = threading.Event()
    thing = Thing()

    def blocking() -> Thing:
        started.set()
        release.wait(30)
        return thing

    async def scenario() -> None:
        waiter = asyncio.ensure_future(closing_in_thread(blocking))
        await asyncio.to_thread(started.wait, 30)
        assert not waiter.done()

    asyncio.run(scenario())  # ends, cancelling the waiter, and closes its loop
    release.set()
    assert thing.closed.wait(30), "the result that outlived its loop was never closed"
