"""Parity under QUIC over real UDP with deterministic loss: a bulk stream through
a UDP forwarder that drops every 37th datagram each way arrives whole, the codec
repairs what was dropped, and QUIC sees (and backs off for) only a few losses;
loss in bursts that parity cannot repair (and that hit parity and ACKs too)
never stalls a copy: it completes, byte for byte, with QUIC resending the rest.
Forged data and parity frames injected from the dialer's own address ahead of
every group neither stall nor corrupt an upload: each is dropped and counted.

Real QUIC over loopback UDP through a real forwarding socket pair; no mocks.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import struct

import pytest

from gpumesh.identity.keys import Identity
from gpumesh.protocol.fec import DATA, PARITY
from gpumesh.transport.endpoint import QuicEndpoint
from gpumesh.transport.quic import QuicLink
from gpumesh.transport.quicsetup import fec_mode
from gpumesh.transport.session import Session, accept_session, open_session
from gpumesh.transport.stream import Stream
from tests.integration.conftest import arun

SIZE = 6 * 1024 * 1024
EVERY = 37


@pytest.fixture(autouse=True)
def _parity_on_demand(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dialers here ask for parity (``auto``; the default is ``off``)."""
    monkeypatch.setenv("GPUMESH_FEC", "auto")


class LossyForwarder:
    """Forwards datagrams between one client and a server, dropping every Nth each way."""

    def __init__(
        self, server: tuple[str, int], every: int, delay: float = 0.0, burst: int = 1
    ) -> None:
        self.server = server
        self.every = every
        self.burst = burst
        """Datagrams dropped in a row each time (1: one alone)."""
        self.delay = delay
        """Seconds each datagram waits before it goes on (one way)."""
        self.front = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.front.bind(("127.0.0.1", 0))
        self.front.setblocking(False)
        self.back = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.back.bind(("127.0.0.1", 0))
        self.back.setblocking(False)
        for sock in (self.front, self.back):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
        self.client: tuple[str, int] | None = None
        self.seen = {"up": 0, "down": 0}
        self.dropped = {"up": 0, "down": 0}
        self.frames = 0
        """Datagrams that were FEC frames (either way)."""
        loop = asyncio.get_running_loop()
        loop.add_reader(self.front.fileno(), self._pump, self.front, "up")
        loop.add_reader(self.back.fileno(), self._pump, self.back, "down")

    @property
    def address(self) -> tuple[str, int]:
        name = self.front.getsockname()
        return (name[0], name[1])

    def _pump(self, sock: socket.socket, way: str) -> None:
        while True:
            try:
                data, source = sock.recvfrom(65535)
            except BlockingIOError:
                return
            if way == "up":
                self.client = source
            self.seen[way] += 1
            if data and data[0] in (DATA, PARITY):
                self.frames += 1
            # The burst ends at every Nth: the handshake's first datagrams go through.
            if (self.seen[way] - 1 + self.burst) % self.every < self.burst:
                self.dropped[way] += 1
                continue
            if self.delay:
                asyncio.get_running_loop().call_later(self.delay, self._forward, data, way)
            else:
                self._forward(data, way)

    def _forward(self, data: bytes, way: str) -> None:
        if self.front.fileno() < 0:
            return  # closed meanwhile
        try:
            if way == "up":
                self.back.sendto(data, self.server)
            elif self.client is not None:
                self.front.sendto(data, self.client)
        except BlockingIOError:
            self.dropped[way] += 1  # a full buffer drops like the network would

    def close(self) -> None:
        loop = asyncio.get_running_loop()
        for sock in (self.front, self.back):
            loop.remove_reader(sock.fileno())
            sock.close()


class ForgingForwarder(LossyForwarder):
    """Also an attacker on the path who can watch and inject but not drop: for each
    group id it sees on the way up it first sends, from the dialer's address as the
    provider sees it (the forwarder's own), forged frames for that group and the ones
    its id would have next if ids counted up: a data frame for every index, as the
    7 bytes that stalled uploads and with room for a tag; then both parities of the
    group before it (parity claiming a whole group would close it before its real
    frames came, which ends a stall instead of making one)."""

    AHEAD = 3
    """Group ids forged for per id seen: that one and the next ones up."""
    TAG_ROOM = 16
    """Bytes a forged frame keeps where a tag would be."""

    def __init__(self, server: tuple[str, int], every: int, delay: float, burst: int) -> None:
        super().__init__(server, every, delay, burst)
        self.injected = 0
        self._attacked: set[int] = set()

    def _forward(self, data: bytes, way: str) -> None:
        if way == "up" and len(data) > 6 and data[0] in (DATA, PARITY):
            seen = int.from_bytes(data[1:5], "big")
            if seen not in self._attacked:
                self._attacked.add(seen)
                forged: list[bytes] = []
                for step in range(self.AHEAD):
                    group = (seen + step) & 0xFFFFFFFF
                    for index in range(16):
                        header = struct.pack("!BIB", DATA, group, index)
                        forged += [header + b"\x00", header + bytes(1 + self.TAG_ROOM)]
                before = (seen - 1) & 0xFFFFFFFF
                forged += [
                    struct.pack("!BIB", PARITY, before, which << 6 | 16) + bytes(3 + self.TAG_ROOM)
                    for which in (0, 1)
                ]
                self._inject(forged)
        super()._forward(data, way)

    def _inject(self, forged: list[bytes]) -> None:
        for frame in forged:
            try:
                self.back.sendto(frame, self.server)
            except BlockingIOError:
                continue
            self.injected += 1


class BlindForgingForwarder(ForgingForwarder):
    """The same attacker where no real frame shows a group id: with every 4th
    datagram on the way up it sends forged data and parity frames of random ids."""

    def _forward(self, data: bytes, way: str) -> None:
        if way == "up" and self.seen["up"] % 4 == 0:
            group = int.from_bytes(os.urandom(4), "big")
            self._inject(
                [
                    struct.pack("!BIB", DATA, group, 0) + bytes(1 + self.TAG_ROOM),
                    struct.pack("!BIB", PARITY, group, 16) + bytes(3 + self.TAG_ROOM),
                ]
            )
        LossyForwarder._forward(self, data, way)


async def _bulk_through_loss(
    *,
    provider_fec: str,
    every: int = EVERY,
    delay: float = 0.0,
    size: int = SIZE,
    burst: int = 1,
    forwarder_type: type[LossyForwarder] = LossyForwarder,
) -> tuple[LossyForwarder, Session, QuicLink]:
    """Send ``size`` bytes dialer -> provider through the forwarder; check the hash."""
    provider, dialer = Identity.generate(), Identity.generate()
    payload = os.urandom(size)
    received: asyncio.Future[tuple[str, QuicLink]] = asyncio.get_running_loop().create_future()
    tasks: set[asyncio.Future[None]] = set()

    async def serve(link: QuicLink) -> None:
        link.policy.fec_mode = provider_fec  # "off": what a provider one version behind does
        accepted = await accept_session(link, provider, "provider", lambda key: None)
        link.buffer_limit = 0

        async def sink(stream: Stream) -> None:
            digest = hashlib.sha256()
            while chunk := await stream.read_data():
                digest.update(chunk)
            received.set_result((digest.hexdigest(), link))

        link.on_stream = lambda stream: tasks.add(asyncio.ensure_future(sink(stream)))
        for stream in accepted.early:
            link.on_stream(stream)

    endpoint = QuicEndpoint.listen(
        provider,
        "127.0.0.1",
        0,
        on_link=lambda link: tasks.add(asyncio.ensure_future(serve(link))),
    )
    forwarder = forwarder_type(endpoint.local_address, every, delay, burst)
    session = await open_session(
        dialer, "dialer", [forwarder.address], provider.public_key, timeout=10
    )
    await session.established()
    stream = session.open_stream()
    await stream.send_data(payload)
    stream.end_data()
    digest, provider_link = await asyncio.wait_for(received, 120)
    assert digest == hashlib.sha256(payload).hexdigest()
    session.close()
    endpoint.close()
    forwarder.close()
    return forwarder, session, provider_link


def test_parity_repairs_random_loss_so_quic_hardly_sees_it() -> None:
    async def scenario() -> None:
        forwarder, session, provider_link = await _bulk_through_loss(provider_fec="auto")
        link = session.link
        assert link.policy.fec_peer and provider_link.policy.fec_peer  # both ends take FEC
        assert link.fec_encoder is not None  # the dialer's first loss turned parity on
        decoder = provider_link.fec_decoder
        assert decoder is not None
        dropped_up = forwarder.dropped["up"]
        assert dropped_up > 100
        # Nearly every datagram dropped on the way up was rebuilt by the provider...
        assert decoder.counters.repaired >= dropped_up // 2
        # ...so QUIC declared only a small part of them lost (those before parity
        # was on, and the few that fell on parity or ACKs).
        assert link.loss_total() * 5 < dropped_up, (link.loss_total(), dropped_up)

    arun(scenario())


def test_a_peer_without_fec_still_gets_every_byte_without_frames() -> None:
    async def scenario() -> None:
        forwarder, session, provider_link = await _bulk_through_loss(provider_fec="off")
        assert not session.link.policy.fec_peer  # the provider did not say it takes FEC
        assert session.link.fec_encoder is None
        assert provider_link.fec_decoder is None
        assert forwarder.frames == 0  # nothing but plain QUIC went over the wire
        assert session.link.loss_total() > 0  # QUIC repaired the loss itself

    arun(scenario())


def test_a_clean_short_link_sends_plain_quic() -> None:
    async def scenario() -> None:
        forwarder, session, _ = await _bulk_through_loss(
            provider_fec="auto", every=10**9, size=512 * 1024
        )
        assert session.link.policy.fec_peer  # offered and taken...
        assert session.link.fec_encoder is None  # ...but no loss, no long round trip
        assert forwarder.frames == 0

    arun(scenario())


def test_a_long_link_sends_parity_from_the_start() -> None:
    async def scenario() -> None:
        # 2 x 15 ms: a round trip over FEC_LONG_RTT, and no loss at all
        forwarder, session, _ = await _bulk_through_loss(
            provider_fec="auto", every=10**9, delay=0.015, size=1024 * 1024
        )
        encoder = session.link.fec_encoder
        assert encoder is not None and encoder.counters.sent_parity > 0
        assert session.link.loss_total() == 0
        assert forwarder.frames > 0

    arun(scenario())


def test_bursts_of_loss_beyond_parity_never_stall_a_copy() -> None:
    async def scenario() -> None:
        # Each way, 6 datagrams in a row of every 300 (2% loss, in bursts that can hit
        # one group past its two parities), over a 20 ms round trip: a long link, so
        # parity is on from the start. _bulk_through_loss checks the hash under its
        # ceiling.
        forwarder, session, provider_link = await _bulk_through_loss(
            provider_fec="auto", every=300, burst=6, delay=0.01, size=4 * 1024 * 1024
        )
        assert forwarder.dropped["up"] >= 6 * 8  # the bursts happened...
        decoder = provider_link.fec_decoder
        assert decoder is not None and decoder.counters.given_up > 0  # ...beyond parity
        assert session.link.loss_total() > 0  # QUIC resent what parity could not
        assert decoder.held == 0  # nothing left waiting behind a gap

    arun(scenario())


def test_forged_frames_from_the_peers_address_neither_stall_nor_corrupt_an_upload() -> None:
    async def scenario() -> None:
        # The default setting: parity starts at the dialer's first loss (every 37th
        # datagram dropped), and from then on every group is attacked before its
        # real frames arrive.
        forwarder, session, provider_link = await _bulk_through_loss(
            provider_fec="auto", forwarder_type=ForgingForwarder
        )
        assert isinstance(forwarder, ForgingForwarder)
        assert session.link.fec_encoder is not None and forwarder.frames > 0
        decoder = provider_link.fec_decoder
        assert decoder is not None
        # _bulk_through_loss checked the hash: every byte arrived, none forged.
        assert forwarder.injected > 1000
        # Each forgery that reached the provider was dropped and counted (loopback
        # loses none unless a socket buffer overflows: half is a floor, not a rate).
        assert forwarder.injected // 2 <= decoder.counters.dropped <= forwarder.injected
        assert decoder.counters.forged > forwarder.injected // 4
        assert decoder.counters.repaired > 0  # parity still did its work
        assert decoder.held == 0

    arun(scenario())


def test_forged_fec_frames_on_the_default_setting_cost_an_upload_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Parity is off by default: neither end offers it, so forged frames from the
    dialer's address meet no decoder and are dropped as not QUIC."""
    monkeypatch.delenv("GPUMESH_FEC")
    assert fec_mode() == "off"

    async def scenario() -> None:
        forwarder, session, provider_link = await _bulk_through_loss(
            provider_fec=fec_mode(), forwarder_type=BlindForgingForwarder
        )
        assert isinstance(forwarder, BlindForgingForwarder)
        assert forwarder.injected > 1000
        # _bulk_through_loss checked the hash: every byte arrived, none forged.
        assert not session.link.policy.fec_peer and not provider_link.policy.fec_peer
        assert session.link.fec_encoder is None and provider_link.fec_decoder is None
        assert session.link.policy.early_duplicates == 0  # no copies without parity either

    arun(scenario())
