"""A re-dial's first try at the last hole-punched address (``open_session(punched=)``),
with real agents on loopback and real QUIC from one shared socket: the address
that answers as the peer gives a direct session said to be hole-punched (and not
stored as one of the peer's own addresses); one that answers with another key,
or not at all, only hands the dial to the usual addresses. The NAT lab test
(test_nat_node.py) shows the same across real NATs, with the relay left alone."""

from __future__ import annotations

from collections.abc import Callable

from gpumesh.client.node import Node
from gpumesh.client.pool import PUNCHED_KEEP, SessionPool
from gpumesh.errors import ConnectionLostError
from gpumesh.protocol.messages import Ping, Pong, StatusRequest
from gpumesh.transport.outgoing import OutgoingSocket
from gpumesh.transport.session import RelayHint, Session, open_session
from tests.integration.conftest import arun, pair_both, sharing, sharing_relayed
from tests.integration.test_outgoing_socket import CEILING, _closed_port


def test_a_punched_address_is_tried_first_and_a_wrong_one_falls_back(
    make_node: Callable[[str], Node],
) -> None:
    alice, carol, bob = make_node("alice"), make_node("carol"), make_node("bob")

    async def scenario() -> None:
        async with sharing(alice) as to_alice, sharing(carol) as to_carol:
            pair_both(alice, bob)
            pair_both(carol, bob)
            key = bob.peer("alice").public_key
            at_alice = ("127.0.0.1", to_alice.address[1])
            outgoing = OutgoingSocket(lambda: bob.home.identity)
            try:

                async def dial(punched: tuple[str, int], addresses: list[tuple[str, int]]) -> str:
                    session = await open_session(
                        bob.home.identity,
                        "bob",
                        addresses,
                        key,
                        timeout=3.0,
                        via=outgoing,
                        punched=punched,
                    )
                    try:
                        assert isinstance(await session.request(Ping(sent=0.0)), Pong)
                        assert session.peer_name == "alice"
                        kept = session.dialable_address()
                        return f"{session.path} at {session.address} remember {kept}"
                    finally:
                        session.close()

                # Alice answers at the punched address: a hole-punched direct path,
                # not one of her own addresses to store.
                found = await dial(at_alice, [])
                assert (
                    found
                    == f"direct (hole-punched) 127.0.0.1:{at_alice[1]} at {at_alice} remember None"
                )
                # Carol answers there with her key: alice's own address decides.
                wrong = ("127.0.0.1", to_carol.address[1])
                found = await dial(wrong, [at_alice])
                assert found == f"direct at {at_alice} remember {at_alice}"
                # Nothing answers there at all.
                found = await dial(("127.0.0.1", _closed_port()), [at_alice])
                assert found == f"direct at {at_alice} remember {at_alice}"
            finally:
                outgoing.close()

    arun(scenario())


def test_the_pool_forgets_a_punched_address_on_deny_and_after_a_while(
    make_node: Callable[[str], Node],
) -> None:
    alice, bob = make_node("alice"), make_node("bob")
    now = [1000.0]

    async def scenario() -> None:
        async with sharing(alice) as to_alice:
            pair_both(alice, bob)
            at_alice = ("127.0.0.1", to_alice.address[1])
            peer = bob.peer("alice")
            peer_id = str(peer.node_id)
            outgoing = OutgoingSocket(lambda: bob.home.identity)
            pool = SessionPool(outgoing=outgoing, clock=lambda: now[0])
            bob.pool = pool

            async def lend_through(punched: tuple[str, int]) -> None:
                async def dial() -> Session:
                    return await open_session(
                        bob.home.identity, "bob", [], peer.public_key, timeout=3.0,
                        via=outgoing, punched=punched,
                    )  # fmt: skip

                async with pool.lend(peer, dial) as session:
                    await session.request(StatusRequest())

            try:
                await lend_through(at_alice)
                assert pool.punched(peer_id) == at_alice
                # The session ends: its address is kept a while, then forgotten.
                pool.drop(peer_id, "test")
                assert pool.punched(peer_id) == at_alice
                now[0] += PUNCHED_KEEP + 1
                assert pool.punched(peer_id) is None
                # A deny forgets it at once, with the session.
                await lend_through(at_alice)
                assert pool.punched(peer_id) == at_alice
                bob.deny("alice")
                pool.sweep(bob.home.store)
                assert pool.sessions() == []
                assert pool.punched(peer_id) is None
            finally:
                pool.close()
                bob.pool = None

    arun(scenario())


def test_a_redial_after_a_silent_drop_takes_over_the_providers_punched_path(
    relayed_alice: tuple[Node, Node, str],
) -> None:
    """bob's session ends on his side only (a network blip: alice never hears of it)
    and he re-dials alice's punched address: her agent maps it to the old session's
    punched path, still open, and the new connection takes that path over, so it
    lives on when her old connection ends and lets the path go."""
    alice, bob, relay = relayed_alice

    async def scenario() -> None:
        async with sharing_relayed(alice, bob) as agent:
            assert agent.endpoint is not None
            outgoing = OutgoingSocket(lambda: bob.home.identity)
            key = alice.home.identity.public_key
            hint = RelayHint(relay)
            try:
                first = await open_session(
                    bob.home.identity, "bob", [], key, relays=[hint], via=outgoing
                )
                assert isinstance(await first.request(Ping(sent=0.0)), Pong)
                await first.wait_for_punching(CEILING)
                punched = first.punched_address
                assert punched is not None, first.path
                first.link.abort(ConnectionLostError("a blip"))  # alice is not told
                again = await open_session(
                    bob.home.identity, "bob", [], key, relays=[hint], via=outgoing, punched=punched
                )
                assert again.punched_before == punched and not again.through_relay
                assert isinstance(await again.request(Ping(sent=0.0)), Pong)
                (old,) = [link for link in agent.endpoint.links if link.path is not None
                          and link.path.link is not link]  # fmt: skip
                old.close()
                agent.endpoint._forget(old)  # its 3 s linger, without the wait
                assert isinstance(await again.request(Ping(sent=0.0), timeout=CEILING), Pong)
                again.close()
            finally:
                outgoing.close()

    arun(scenario())
