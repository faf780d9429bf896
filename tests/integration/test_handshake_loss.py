"""Losses before parity starts cost a dial nothing: its first datagrams go twice.

Real QUIC over real UDP on loopback, through a small link in this process (a UDP
forwarder that delays each datagram 30 ms each way, in order, and drops chosen
ones): a dialer connects and uploads 4 MiB. The link drops every other datagram
among the dialer's first ones: its Initial, its Finished, the first flight of
the upload, which all leave before parity can start (a peer says it takes FEC
frames in its Welcome, two round trips in). Each of them goes out twice, so each
still arrives once and QUIC declares nothing lost.

Why this matters: qh3's congestion control takes every lost packet for
congestion and leaves slow start for good at the first one. At 0.5% loss each
way, about one upload in eight (1 - 0.995^25) loses one of its ~25 early
datagrams; that copy then runs with a window of a few datagrams, growing by one
per round trip: it crawls. Without the copies this test's link loses a dozen
of the dialer's packets, and the window stays near where the first loss cut it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import deque
from collections.abc import AsyncIterator
from typing import cast

import pytest

from gpumesh.identity.keys import Identity
from gpumesh.protocol.addresses import Address
from gpumesh.transport.endpoint import QuicEndpoint
from gpumesh.transport.quic import QuicLink, Recovery
from gpumesh.transport.stream import Stream
from gpumesh.transport.udp import open_udp_socket
from tests.integration.window import UPLOAD, Receiver, assert_kept_slow_start

DELAY = 0.03
"""Seconds each way: a link long enough that parity would start at once (25 ms+)."""
EARLY = 24
"""The dialer's datagrams among which the link drops every other one."""


@pytest.fixture(autouse=True)
def _parity_on_demand(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copies come with parity, which is off unless asked for (``auto`` here)."""
    monkeypatch.setenv("GPUMESH_FEC", "auto")


class _Link(asyncio.DatagramProtocol):
    """Datagrams from the dialer go to the provider and back, each ``DELAY`` late, in
    order; the first ``EARLY`` of one side (the dialer's, or with ``provider_loses``
    the provider's) lose every other one."""

    def __init__(self, provider: Address, *, provider_loses: bool = False) -> None:
        self.provider = provider
        self.provider_loses = provider_loses
        self.dialer: Address | None = None
        self.transport: asyncio.DatagramTransport | None = None
        self.from_dialer = 0
        self.from_provider = 0
        self.dropped = 0
        self._queue: deque[tuple[float, bytes, Address]] = deque()
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | bytes, int]) -> None:
        source = (str(addr[0]), addr[1])
        if source == self.provider:
            if self.dialer is None:
                return
            index = self.from_provider
            self.from_provider += 1
            if self.provider_loses and index < EARLY and index % 2 == 0:
                self.dropped += 1
                return
            to = self.dialer
        else:
            self.dialer = source
            index = self.from_dialer
            self.from_dialer += 1
            if not self.provider_loses and index < EARLY and index % 2 == 0:
                self.dropped += 1
                return
            to = self.provider
        self._queue.append((self._loop.time() + DELAY, data, to))
        if self._timer is None:
            self._timer = self._loop.call_at(self._queue[0][0], self._release)

    def _release(self) -> None:
        self._timer = None
        now = self._loop.time()
        while self._queue and self._queue[0][0] <= now:
            _, data, to = self._queue.popleft()
            if self.transport is not None:
                self.transport.sendto(data, to)
        if self._queue:
            self._timer = self._loop.call_at(self._queue[0][0], self._release)


@contextlib.asynccontextmanager
async def _dialled_through(
    endpoint: QuicEndpoint, provider: Identity, *, provider_loses: bool = False
) -> AsyncIterator[tuple[_Link, QuicLink]]:
    """A link in front of ``endpoint`` (see :class:`_Link`) and a dial through it."""
    loop = asyncio.get_running_loop()
    transport, lab = await loop.create_datagram_endpoint(
        lambda: _Link(("127.0.0.1", endpoint.local_address[1]), provider_loses=provider_loses),
        sock=open_udp_socket("127.0.0.1", 0),  # big buffers: the link itself drops nothing else
    )
    link: QuicLink | None = None
    try:
        lab_address = transport.get_extra_info("sockname")
        link = await QuicEndpoint.dial(
            ("127.0.0.1", lab_address[1]),
            expected_key=provider.public_key,
            timeout=20,
            local_host="127.0.0.1",
        )
        yield lab, link
    finally:
        if link is not None:
            link.close()
        transport.close()


async def _upload_through_the_link() -> tuple[Recovery, int, int]:
    provider = Identity.generate()
    receiver = Receiver()
    endpoint = QuicEndpoint.listen(provider, "127.0.0.1", 0, on_link=receiver.on_link)
    try:
        async with _dialled_through(endpoint, provider) as (lab, link):
            stream = link.open_stream()
            await stream.send_data(os.urandom(UPLOAD))
            stream.end_data()
            await asyncio.wait_for(receiver.done.wait(), 120)
            assert len(receiver.received) == UPLOAD
            recovery = link.recovery()
            assert recovery is not None
            return recovery, lab.dropped, link.policy.early_duplicates
    finally:
        receiver.cancel()
        endpoint.close()


def test_a_dial_that_loses_its_first_datagrams_keeps_slow_start() -> None:
    recovery, dropped, duplicates = asyncio.run(_upload_through_the_link())
    assert dropped == EARLY // 2
    assert duplicates >= EARLY // 2  # every datagram the link dropped had a copy behind it
    assert_kept_slow_start(recovery)


async def _download_through_the_link() -> tuple[Recovery, int, int]:
    """The dialer asks for ``UPLOAD`` bytes; the provider's first datagrams (its
    handshake flight, then the first of the answer) cross the lossy side."""
    provider = Identity.generate()
    writers: set[asyncio.Task[None]] = set()
    accepted: list[QuicLink] = []

    async def answer(stream: Stream) -> None:
        while await stream.read_data():
            pass
        await stream.send_data(os.urandom(UPLOAD))
        stream.end_data()

    def on_link(link: QuicLink) -> None:
        accepted.append(link)

        def on_stream(stream: Stream) -> None:
            writers.add(asyncio.create_task(answer(stream)))

        link.on_stream = on_stream

    endpoint = QuicEndpoint.listen(provider, "127.0.0.1", 0, on_link=on_link)
    try:
        async with _dialled_through(endpoint, provider, provider_loses=True) as (lab, link):
            stream = link.open_stream()
            await stream.send_data(b"send")
            stream.end_data()
            received = 0
            async with asyncio.timeout(120):
                while chunk := await stream.read_data():
                    received += len(chunk)
            assert received == UPLOAD
            assert len(accepted) == 1
            recovery = accepted[0].recovery()
            assert recovery is not None
            return recovery, lab.dropped, accepted[0].policy.early_duplicates
    finally:
        for task in writers:
            task.cancel()
        endpoint.close()


def test_a_provider_that_loses_its_handshake_flight_keeps_slow_start() -> None:
    """The accepting side copies its datagrams too, its handshake flight included
    (within three times what the dialer sent it, until the dialer's address is
    validated): the link drops every other one of its first datagrams, each still
    arrives once, and its download runs in slow start."""
    recovery, dropped, duplicates = asyncio.run(_download_through_the_link())
    assert dropped == EARLY // 2
    assert duplicates >= EARLY // 2
    assert_kept_slow_start(recovery)
