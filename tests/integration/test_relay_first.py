"""The relay without :data:`RELAY_DELAY` where waiting for the direct path would only
add it: a peer whose last session came through the relay (``relay_first``, kept
per peer by the session pool, or read from the store's ``last_path`` by a command
run in-process) and a direct attempt that already failed outright.

Real agent, real ``gpumesh-relay`` and real QUIC on loopback. No timing decides:
``RELAY_DELAY`` is raised far past the test's ceiling, so a dial that waited for
it could not finish in time, and the dial's own record says the relay attempt
started first, the direct one beside it (or right after the direct one failed)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest

import gpumesh.transport.session as session_module
from gpumesh.client.node import Node
from gpumesh.client.pool import SessionPool
from gpumesh.protocol.messages import Ping, Pong, StatusRequest
from gpumesh.transport.outgoing import OutgoingSocket
from gpumesh.transport.session import RelayHint, Session, open_session, went_through_relay
from tests.integration.conftest import arun, sharing_relayed
from tests.integration.test_outgoing_socket import CEILING, _closed_port

NEVER = 3600.0
"""RELAY_DELAY for these tests: far past CEILING, so only a dial that skips it ends."""
DIAL_TIMEOUT = 2 * CEILING
"""Each attempt's own timeout: past CEILING too, so a silent direct attempt never
fails in time to let the relay start the usual way."""


@pytest.fixture
def black_hole() -> Iterator[tuple[str, int]]:
    """A loopback UDP port that takes datagrams and never answers (nor refuses)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()


def _names(session: Session) -> list[str]:
    assert session.dial_record is not None
    return [event for event, _ in session.dial_record.events]


def test_relay_first_starts_the_relay_beside_a_silent_direct_address(
    relayed_alice: tuple[Node, Node, str],
    black_hole: tuple[str, int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    alice, bob, relay = relayed_alice
    monkeypatch.setattr(session_module, "RELAY_DELAY", NEVER)

    async def scenario() -> None:
        async with sharing_relayed(alice, bob):
            key = alice.home.identity.public_key
            outgoing = OutgoingSocket(lambda: bob.home.identity)
            try:
                # In-process (a socket of its own) and from a node's shared socket.
                for via in (None, outgoing):
                    async with asyncio.timeout(CEILING):
                        session = await open_session(
                            bob.home.identity, "bob", [black_hole], key,
                            timeout=DIAL_TIMEOUT, relays=[RelayHint(relay)], via=via,
                            relay_first=True,
                        )  # fmt: skip
                    try:
                        assert isinstance(await session.request(Ping(sent=0.0)), Pong)
                        assert session.through_relay and session.peer_name == "alice"
                        # The relay started at once, first. In-process the direct
                        # attempt races it (the silent one never failed); from a shared
                        # socket there is none (it would stop as the relay starts, see
                        # _open_with_relay).
                        beside = ["direct started"] if via is None else []
                        expected = ["relay started", *beside, "relay won"]
                        assert _names(session) == expected
                    finally:
                        session.close()
            finally:
                outgoing.close()

    arun(scenario())


def test_an_in_process_dial_starts_the_relay_at_once_when_the_store_says_relayed(
    relayed_alice: tuple[Node, Node, str],
    black_hole: tuple[str, int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A command run in-process has no pool: what its last session with the peer took
    comes from the store (``last_path``), written by the dial before it. Its second
    dial through a silent direct address ends only if it starts the relay at once."""
    alice, bob, relay = relayed_alice

    async def dial_names() -> tuple[list[str], str]:
        async with asyncio.timeout(CEILING), bob.session("alice", timeout=DIAL_TIMEOUT) as s:
            assert isinstance(await s.request(Ping(sent=0.0)), Pong)
            return _names(s), s.path

    async def scenario() -> None:
        async with sharing_relayed(alice, bob) as agent:
            assert bob.pool is None
            alice_key = alice.home.identity.public_key
            silent = f"{black_hole[0]}:{black_hole[1]}"
            bob.home.store.save_peer(alice_key, "alice", [silent], relay)
            assert bob.peer("alice").last_path == ""
            # First dial: nothing known, so the relay waits RELAY_DELAY (left as it is).
            names, path = await dial_names()
            assert names == ["direct started", "relay started", "relay won"]
            # Relayed, or moved to a direct path by punching (loopback lets it through).
            assert went_through_relay(path), path
            assert went_through_relay(bob.peer("alice").last_path)
            # Second dial: the relay first. (A dial that waited for RELAY_DELAY now could
            # not end in time either.)
            # (Punching on loopback reaches the address alice listens on, which the
            # store keeps to dial first: silence it again.)
            bob.home.store.touch_peer(bob.peer("alice").node_id, address=silent)
            monkeypatch.setattr(session_module, "RELAY_DELAY", NEVER)
            names, _ = await dial_names()
            assert names == ["relay started", "direct started", "relay won"]
            # A session that came up direct: the next dial leaves the relay alone.
            at_alice = f"127.0.0.1:{agent.address[1]}"
            bob.home.store.save_peer(alice_key, "alice", [at_alice], relay)
            bob.home.store.touch_peer(bob.peer("alice").node_id, path="direct")
            names, path = await dial_names()
            assert (names, path) == (["direct started", "direct won"], "direct")

    arun(scenario())


def test_a_direct_attempt_that_failed_outright_hands_over_to_the_relay_at_once(
    relayed_alice: tuple[Node, Node, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The address refuses (ICMP port unreachable): the relay starts when it does,
    not RELAY_DELAY after the dial started."""
    alice, bob, relay = relayed_alice
    monkeypatch.setattr(session_module, "RELAY_DELAY", NEVER)

    async def scenario() -> None:
        async with sharing_relayed(alice, bob):
            async with asyncio.timeout(CEILING):
                session = await open_session(
                    bob.home.identity, "bob", [("127.0.0.1", _closed_port())],
                    alice.home.identity.public_key, timeout=DIAL_TIMEOUT,
                    relays=[RelayHint(relay)],
                )  # fmt: skip
            try:
                assert session.through_relay
                assert _names(session) == [
                    "direct started",
                    "direct failed",
                    "relay started",
                    "relay won",
                ]
            finally:
                session.close()

    arun(scenario())


def test_the_pool_remembers_a_relayed_peer_until_a_direct_session_or_a_deny(
    relayed_alice: tuple[Node, Node, str],
) -> None:
    alice, bob, relay = relayed_alice

    async def scenario() -> None:
        async with sharing_relayed(alice, bob) as agent:
            peer = bob.peer("alice")
            peer_id = str(peer.node_id)
            at_alice = ("127.0.0.1", agent.address[1])
            outgoing = OutgoingSocket(lambda: bob.home.identity)
            pool = SessionPool(outgoing=outgoing)

            async def lend(*, relayed: bool) -> None:
                async def dial() -> Session:
                    return await open_session(
                        bob.home.identity, "bob", [] if relayed else [at_alice],
                        peer.public_key, timeout=CEILING,
                        relays=[RelayHint(relay)] if relayed else (), via=outgoing,
                    )  # fmt: skip

                async with pool.lend(peer, dial) as session:
                    await session.request(StatusRequest())
                    assert session.through_relay == relayed

            try:
                assert not pool.relay_first(peer_id)
                await lend(relayed=True)
                assert pool.relay_first(peer_id)
                # Kept when the session ends (the next dial is the one it helps).
                pool.drop(peer_id, "test")
                assert pool.relay_first(peer_id)
                # A session that comes up direct replaces it.
                await lend(relayed=False)
                assert not pool.relay_first(peer_id)
                pool.drop(peer_id, "test")
                # A deny forgets it at once, with the session.
                await lend(relayed=True)
                assert pool.relay_first(peer_id)
                bob.deny("alice")
                pool.sweep(bob.home.store)
                assert pool.sessions() == []
                assert not pool.relay_first(peer_id)
            finally:
                pool.close()

    arun(scenario())


def test_a_silent_punched_address_stops_when_the_relay_is_tried_from_the_shared_socket(
    relayed_alice: tuple[Node, Node, str], black_hole: tuple[str, int]
) -> None:
    """The re-dial's first try at a stale punched address gets no answer: from a shared
    socket it stops as the usual dial (here: straight to the relay) takes over, as the
    relay may punch to that address from that port."""
    alice, bob, relay = relayed_alice

    async def scenario() -> None:
        async with sharing_relayed(alice, bob):
            outgoing = OutgoingSocket(lambda: bob.home.identity)
            try:
                async with asyncio.timeout(CEILING):
                    session = await open_session(
                        bob.home.identity, "bob", [], alice.home.identity.public_key,
                        timeout=DIAL_TIMEOUT, relays=[RelayHint(relay)], via=outgoing,
                        punched=black_hole,
                    )  # fmt: skip
                try:
                    assert session.through_relay and session.punched_before is None
                    names = _names(session)
                    assert names[:2] == ["punched started", "punched stopped"], names
                    assert names[-2:] == ["relay started", "relay won"], names
                finally:
                    session.close()
            finally:
                outgoing.close()

    arun(scenario())
