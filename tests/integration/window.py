"""What the QUIC window tests share: a provider's side that reads each stream to its
end, and the check that a 4 MiB upload kept the window a lossless link gives."""

from __future__ import annotations

import asyncio

from gpumesh.transport.quic import QuicLink, Recovery
from gpumesh.transport.stream import Stream

UPLOAD = 4 * 1024 * 1024
INITIAL_WINDOW = 14_440
"""qh3's initial congestion window (10 datagrams of MAX_DATAGRAM)."""


class Receiver:
    """Reads every stream of every link it is given (``on_link``) into ``received``;
    ``done`` is set as a stream ends."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.done = asyncio.Event()
        self._readers: set[asyncio.Task[None]] = set()

    def on_link(self, link: QuicLink) -> None:
        def on_stream(stream: Stream) -> None:
            self._readers.add(asyncio.create_task(self._read_all(stream)))

        link.on_stream = on_stream

    async def _read_all(self, stream: Stream) -> None:
        while chunk := await stream.read_data():
            self.received.extend(chunk)
        self.done.set()

    def cancel(self) -> None:
        for task in self._readers:
            task.cancel()


def assert_kept_slow_start(recovery: Recovery) -> None:
    """Nothing lost, and still in slow start after the upload: slow start doubles the
    window each round trip, so after 4 MiB acknowledged it is far past the initial
    one; out of it after an early loss, the window grows by one datagram per round
    trip and stays near where the loss cut it."""
    assert recovery.lost == 0, recovery
    assert recovery.window > 40 * INITIAL_WINDOW, recovery
