"""Strangers flooding the share port with Initials, against a real agent on loopback.

The flood comes from 16 addresses (127.0.0.2-17: Linux loopback takes all of
127/8): random bytes shaped like Initials, real first flights that never go
on, and clients that echo our Retry and then stall (validated addresses that
never finish a proof). Verdicts count connects and packets, never time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from qh3 import QuicConnection

from gpumesh.agent.ratelimit import ConnectionLimiter
from gpumesh.agent.server import Agent
from gpumesh.errors import AccessDeniedError, GPUMeshError
from gpumesh.protocol.admission import DropReason, RetryTokens, parse_initial
from gpumesh.transport import endpoint as quic_module
from gpumesh.transport.quicsetup import client_configuration
from tests.integration.conftest import arun, pair_both, sharing, until_async

SOURCES = [f"127.0.0.{i}" for i in range(2, 18)]


def junk_initial(token: bytes = b"", dcid: bytes | None = None) -> bytes:
    """A version 1 Initial header (random ids) over random bytes: parses, never decrypts."""
    dcid = dcid if dcid is not None else os.urandom(8)
    header = b"\xc3\x00\x00\x00\x01" + bytes([len(dcid)]) + dcid + b"\x08" + os.urandom(8)
    header += bytes([len(token)]) + token + b"\x44\xb0"  # token, then a 2-byte length
    return header + os.urandom(1200 - len(header))


def first_flight(target: tuple[str, int]) -> tuple[QuicConnection, list[bytes]]:
    client = QuicConnection(configuration=client_configuration())
    client.connect(target, time.monotonic())
    return client, [data for data, _ in client.datagrams_to_send(time.monotonic())]


def retry_of(packet: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(our id it is sent to, the id to use now, token) of a Retry packet, or None."""
    if len(packet) < 23 or packet[0] & 0xF0 != 0xF0:
        return None
    dcid_end = 6 + packet[5]
    scid_end = dcid_end + 1 + packet[dcid_end]
    return packet[6:dcid_end], packet[dcid_end + 1 : scid_end], packet[scid_end:-16]


class Flooder(threading.Thread):
    """Floods ``target`` from :data:`SOURCES` until stopped; counts what it sent.

    Each round, every source sends one junk Initial; every ``stall_every``
    rounds, each also starts a real handshake that it abandons after echoing
    our Retry (or at once, if none comes); every ``junk_token_every`` rounds it
    echoes a Retry with junk instead.
    """

    def __init__(
        self,
        target: tuple[str, int],
        *,
        rounds_per_s: float = 25.0,
        stall_every: int = 5,
        junk_token_every: int = 7,
    ) -> None:
        super().__init__(daemon=True)
        self.target = target
        self.pause = 1.0 / rounds_per_s
        self.stall_every = stall_every
        self.junk_token_every = junk_token_every
        self.stop = threading.Event()
        self.sent = 0
        self.echoed = 0
        self.sockets: list[socket.socket] = []
        for host in SOURCES:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind((host, 0))
            sock.setblocking(False)
            self.sockets.append(sock)
        self.flights = [first_flight(target) for _ in range(2 * len(SOURCES))]

    def run(self) -> None:
        waiting: dict[bytes, QuicConnection] = {}
        round_ = 0
        try:
            while not self.stop.is_set():
                round_ += 1
                for sock in self.sockets:
                    self._send(sock, junk_initial())
                    if round_ % self.stall_every == 0 and self.flights:
                        client, flight = self.flights.pop()
                        waiting[client.host_cid] = client
                        for data in flight:
                            self._send(sock, data)
                    self._answer_retries(sock, waiting, junk=round_ % self.junk_token_every == 0)
                if len(self.flights) < len(SOURCES):
                    self.flights.append(first_flight(self.target))
                self.stop.wait(self.pause)
        finally:
            for sock in self.sockets:
                sock.close()

    def _send(self, sock: socket.socket, data: bytes) -> None:
        with contextlib.suppress(BlockingIOError):
            sock.sendto(data, self.target)
            self.sent += 1

    def _answer_retries(
        self, sock: socket.socket, waiting: dict[bytes, QuicConnection], junk: bool
    ) -> None:
        for _ in range(64):
            try:
                packet = sock.recv(2048)
            except BlockingIOError:
                return
            retry = retry_of(packet)
            if retry is None:
                continue  # the agent's handshake packets: never answered
            client = waiting.pop(retry[0], None)
            if client is None:
                continue  # the answer to a junk Initial
            if junk:
                self._send(sock, junk_initial(token=retry[2], dcid=retry[1]))
            else:
                now = time.monotonic()
                client.receive_datagram(packet, self.target, now)
                for data, _ in client.datagrams_to_send(now):
                    self._send(sock, data)
            self.echoed += 1


@contextlib.contextmanager
def flooding(target: tuple[str, int], **kwargs: Any) -> Iterator[Flooder]:
    flooder = Flooder(target, **kwargs)
    flooder.start()
    try:
        yield flooder
    finally:
        flooder.stop.set()
        flooder.join(10)


def test_a_paired_peer_connects_through_a_flood_of_junk_and_stalled_initials(
    make_node, caplog
) -> None:
    alice, bob = make_node("alice"), make_node("bob")
    connects = 10

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            peak = 0
            successes = 0
            refusals = agent.refusals
            with flooding(agent.address) as flooder:
                # The flood is well under way: the quiet allowance is spent, stalled
                # handshakes hold slots.
                await until_async(
                    lambda: flooder.sent >= 400 and flooder.echoed >= 16,
                    "the flood under way",
                    within=20,
                )
                for _ in range(connects):
                    try:
                        connection = await bob.connect("alice", pings=1, timeout=15.0)
                    except GPUMeshError:
                        pass
                    else:
                        successes += connection.remote.name == "alice"
                    peak = max(peak, agent.limiter.pending)
                    # Spread over the flood (by packets sent, not by time), so later
                    # connects meet stalled handshakes timing out and their penalties.
                    await until_async(
                        lambda mark=flooder.sent + 300: flooder.sent >= mark,
                        "300 more packets of the flood",
                        within=20,
                    )
                await until_async(
                    lambda: refusals.totals[DropReason.PENALIZED] >= 1, "a penalty", within=30
                )
                assert (await bob.connect("alice", pings=1, timeout=15.0)).remote.name == "alice"
                sent = flooder.sent
            assert successes == connects
            assert sent >= 2000
            # No state for the junk: Retries answered it, or it did not decrypt; the
            # validated stalls were capped, and boxed once they failed.
            assert refusals.retries_total >= sent // 4
            assert refusals.totals[DropReason.UNDECRYPTABLE] >= 1
            assert refusals.totals[DropReason.PENALIZED] >= 1
            assert peak <= agent.limiter.max_unvalidated + len(SOURCES) * 4 + 1
            await until_async(lambda: agent.limiter.pending == 0, "no handshake pending", within=20)
            assert agent.limiter.pending == 0

    with caplog.at_level(logging.INFO, logger="gpumesh.agent.server"):
        arun(scenario())
    about_refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    # A summary per 10 s (plus a few failed proofs each), never a line per packet.
    assert len(about_refusals) <= 40


def test_garbage_that_is_no_client_initial_makes_no_connection(make_node, monkeypatch) -> None:
    alice, bob = make_node("alice"), make_node("bob")
    made: list[bool] = []
    real = quic_module.QuicConnection

    def counting(**kwargs: Any) -> QuicConnection:
        made.append(kwargs["configuration"].is_client)
        return real(**kwargs)

    monkeypatch.setattr(quic_module, "QuicConnection", counting)
    dcid = os.urandom(8)
    initial = junk_initial(dcid=dcid)
    garbage = [
        os.urandom(1200),  # most likely not even a long header
        b"\x01" + os.urandom(1300),  # not QUIC
        b"\x41" + os.urandom(1300),  # a short header for no connection
        b"\x3a" + os.urandom(1300),  # a parity-protected frame from no link (FEC)
        b"\xe3" + initial[1:],  # a Handshake packet
        initial[:1199],  # an Initial below the minimum size
        initial[:1] + b"\x6b\x33\x43\xcf" + initial[5:],  # QUIC v2
        initial[:5] + b"\x04" + initial[6:],  # a 4-byte first id
        junk_initial(token=b"R1" + os.urandom(40), dcid=dcid),  # a made-up token
    ]
    rounds = 50

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.bind((SOURCES[0], 0))
                for _ in range(rounds):
                    for packet in garbage[1:]:
                        sock.sendto(packet, agent.address)
                    sock.sendto(bytes([os.urandom(1)[0] & 0xBF]) + garbage[0][1:], agent.address)
                    await asyncio.sleep(0)
            expected = rounds * len(garbage)
            await until_async(
                lambda: sum(agent.refusals.totals.values()) >= expected,
                "every refusal counted",
                within=20,
            )
            assert sum(agent.refusals.totals.values()) == expected
            assert agent.refusals.totals[DropReason.BAD_TOKEN] == rounds
            assert made == []
            assert agent.limiter.pending == 0
            await bob.connect("alice", pings=1)
            assert made.count(False) == 1  # the paired peer's connection, and only it

    arun(scenario())


def test_a_dial_goes_through_a_retry_round_trip_when_the_agent_asks(make_node) -> None:
    alice, bob = make_node("alice"), make_node("bob")

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            # Quiet: the first connection is made at once, no Retry.
            assert (await bob.connect("alice", pings=1)).remote.name == "alice"
            assert agent.endpoint is not None
            assert agent.endpoint.retries_sent == 0
        limiter = ConnectionLimiter(quiet_burst=0)  # what every dial meets under a flood
        agent = Agent(alice.home, host="127.0.0.1", port=0, limiter=limiter)
        await agent.start()
        try:
            bob.pair(alice.pairing_code())  # the agent's new port
            async with bob.session("alice") as session:
                await session.established()
                assert session.peer_name == "alice"
                assert agent.endpoint is not None
                assert agent.endpoint.retries_sent >= 1
                served = [link for link in agent.endpoint.links if not link.is_closed]
                assert len(served) == 1 and served[0].validated
        finally:
            agent.stop()

    arun(scenario())


def test_forged_expired_and_misaddressed_tokens_are_refused(make_node) -> None:
    alice = make_node("alice")
    clock = [time.monotonic()]

    async def retry_token_initials(
        sock: socket.socket, target: tuple[str, int]
    ) -> tuple[QuicConnection, list[bytes]]:
        """The Initials a real client sends after our Retry (it is told the token)."""
        client, flight = first_flight(target)
        for data in flight:
            sock.sendto(data, target)
        loop = asyncio.get_running_loop()
        while True:  # each datagram of the flight got a Retry: take one of this client's
            packet = await asyncio.wait_for(loop.sock_recv(sock, 2048), 10)
            retry = retry_of(packet)
            if retry is not None and retry[0] == client.host_cid:
                break
        client.receive_datagram(packet, target, time.monotonic())
        again = [data for data, _ in client.datagrams_to_send(time.monotonic())]
        header = parse_initial(again[0])
        assert header is not None and header.token
        return client, again

    async def scenario() -> None:
        limiter = ConnectionLimiter(quiet_burst=0)
        agent = Agent(alice.home, host="127.0.0.1", port=0, limiter=limiter)
        await agent.start()
        endpoint = agent.endpoint
        assert endpoint is not None
        endpoint.retry_tokens = RetryTokens(os.urandom(32), clock=lambda: clock[0])
        totals = agent.refusals.totals
        sockets = []
        try:
            for host in SOURCES[:2]:
                sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                sock.bind((host, 0))
                sock.setblocking(False)
                sockets.append(sock)
            here, elsewhere = sockets
            target = agent.address

            # From another address than the one the Retry went to.
            _, initials = await retry_token_initials(here, target)
            for data in initials:
                elsewhere.sendto(data, target)
            await until_async(
                lambda: totals[DropReason.BAD_TOKEN] >= len(initials),
                "each bad token counted",
                within=20,
            )
            assert totals[DropReason.BAD_TOKEN] == len(initials)

            # Forged: one bit of the token flipped.
            _, initials = await retry_token_initials(here, target)
            header = parse_initial(initials[0])
            assert header is not None
            at = initials[0].index(header.token) + 10
            forged = bytearray(initials[0])
            forged[at] ^= 0x40
            here.sendto(bytes(forged), target)
            await until_async(
                lambda: totals[DropReason.BAD_TOKEN] >= len(initials) + 1,
                "the last bad token counted",
                within=20,
            )
            assert totals[DropReason.BAD_TOKEN] == len(initials) + 1

            # Expired: echoed after its lifetime.
            _, initials = await retry_token_initials(here, target)
            clock[0] += endpoint.retry_tokens.lifetime + 1
            here.sendto(initials[0], target)
            await until_async(
                lambda: totals[DropReason.EXPIRED_TOKEN] >= 1, "an expired token counted", within=20
            )
            assert totals[DropReason.EXPIRED_TOKEN] == 1
            assert not endpoint.links

            # The same steps, done right, make a connection.
            _, initials = await retry_token_initials(here, target)
            for data in initials:
                here.sendto(data, target)
            await until_async(lambda: bool(endpoint.links), "a link", within=20)
            assert len(endpoint.links) == 1
        finally:
            for sock in sockets:
                sock.close()
            agent.stop()

    arun(scenario())


@pytest.fixture(autouse=True)
def _loopback_aliases() -> None:
    """The flood needs 127.0.0.2-17; every Linux loopback has them."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.bind((SOURCES[-1], 0))
        except OSError as exc:
            pytest.skip(f"cannot bind {SOURCES[-1]}: {exc}")


def test_a_denied_peer_is_refused_without_boxing_the_address_it_shares(make_node) -> None:
    """A denied peer's proof is good: its refusal used to count as a failed proof,
    which put its address in the penalty box (dropping every peer behind the same
    address for seconds) and logged a warning about failed identity proofs."""
    alice, bob, carol = make_node("alice"), make_node("bob"), make_node("carol")

    async def scenario() -> None:
        limiter = ConnectionLimiter(quiet_burst=0)  # every dial validates its address
        agent = Agent(alice.home, host="127.0.0.1", port=0, limiter=limiter)
        await agent.start()
        try:
            pair_both(alice, bob)
            pair_both(alice, carol)
            alice.deny("bob")
            with pytest.raises(AccessDeniedError, match="alice has denied you access"):
                await bob.connect("alice", pings=1)
            await until_async(lambda: limiter.pending == 0, "no handshake pending", within=20)
            assert limiter.admit("127.0.0.1", True) is not DropReason.PENALIZED
            assert (await carol.connect("alice", pings=1)).remote.name == "alice"
        finally:
            agent.stop()

    arun(scenario())
