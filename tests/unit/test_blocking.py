"""An in_thread call nobody awaits any more (the owner ended a shell while its
container's wait ran) is let go without asyncio's "Future exception was never
retrieved" and its traceback on the process's stderr."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading

import pytest

from gpumesh.blocking import abandon, in_thread

CEILING = 30.0


def _fails(release: threading.Event, done: threading.Event) -> None:
    release.wait(CEILING)
    try:
        raise LookupError("the container was removed")
    finally:
        done.set()


@pytest.mark.parametrize("when", ["while it runs", "after it failed"])
def test_an_abandoned_call_leaves_no_unretrieved_error(
    when: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        release, done = threading.Event(), threading.Event()
        future = in_thread(_fails, release, done)
        if when == "after it failed":
            release.set()
            await asyncio.wait({future}, timeout=CEILING)  # done; its error not looked at
            abandon(future)
        else:
            abandon(future)
            release.set()
            await asyncio.to_thread(done.wait, CEILING)
            await asyncio.sleep(0.05)  # its answer reaches the loop, which drops it
        assert future.done()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(scenario())
        gc.collect()
    assert "never retrieved" not in caplog.text
