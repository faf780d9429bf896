"""The node process's shared dialling socket, in one process: real agents on
loopback, real QUIC. Links to two peers on one socket carry bulk at the same time,
each to its own peer (routed by connection id), and a re-dial leaves from the same
port; ICMP refusals on the shared (unconnected) socket."""

from __future__ import annotations

import asyncio
import select
import socket
from collections.abc import Callable

import pytest

from gpumesh.client.node import Node
from gpumesh.client.pool import SessionPool
from gpumesh.protocol.messages import Ping, Pong
from gpumesh.transport.outgoing import OutgoingSocket
from gpumesh.transport.session import RelayHint, open_session
from gpumesh.transport.udp import UdpSocket, open_udp_socket
from tests.integration.conftest import arun, pair_both, sharing, sharing_relayed

SIZE = 8 * 1024 * 1024
CEILING = 30.0
"""Seconds for the kernel's answer (generous: CI is a loaded 2-core box)."""


def test_two_links_on_one_socket_carry_bulk_at_once_and_a_redial_keeps_the_port(
    make_node: Callable[[str], Node],
) -> None:
    alice, carol, bob = make_node("alice"), make_node("carol"), make_node("bob")

    async def scenario() -> None:
        async with sharing(alice) as to_alice, sharing(carol) as to_carol:
            pair_both(alice, bob)
            pair_both(carol, bob)
            outgoing = OutgoingSocket(lambda: bob.home.identity)
            bob.pool = SessionPool(outgoing=outgoing)
            try:
                first = await asyncio.gather(
                    bob.throughput("alice", SIZE), bob.throughput("carol", SIZE)
                )
                assert [r.peer.name for r in first] == ["alice", "carol"]
                port = outgoing.state().port
                assert port is not None
                warm = {w.peer_name: w.session for w in bob.pool.sessions()}
                assert sorted(warm) == ["alice", "carol"]
                assert {s.link.local_port for s in warm.values()} == {port}
                # Each link reached its own peer, not the other's.
                assert warm["alice"].address == ("127.0.0.1", to_alice.address[1])
                assert warm["carol"].address == ("127.0.0.1", to_carol.address[1])
                assert outgoing.state().links == 2
                # A dropped session is dialled again from the same socket.
                bob.pool.drop(str(alice.info().node_id), "test")
                again = await bob.connect("alice")
                assert again.address == f"127.0.0.1:{to_alice.address[1]}"
                renewed = {w.peer_name: w.session for w in bob.pool.sessions()}
                assert renewed["alice"] is not warm["alice"]
                assert renewed["alice"].link.local_port == port
                assert outgoing.state().port == port
            finally:
                bob.pool.close()
                bob.pool = None
            assert outgoing.state().port is None  # closed with the pool

    arun(scenario())


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_an_icmp_refusal_is_named_and_does_not_cost_the_next_datagram() -> None:
    """With IP_RECVERR the kernel reports an ICMP error once, on the socket's next
    call, whatever it is: a send to another peer must still go out."""
    udp = UdpSocket(open_udp_socket("127.0.0.1", 0))
    listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        udp.report_refusals()
        if not udp.reports_refusals:
            pytest.skip("no IP_RECVERR on this platform")
        listener.bind(("127.0.0.1", 0))
        listener.settimeout(CEILING)
        nobody = ("127.0.0.1", _closed_port())
        udp.send_batch([(b"\x40hello", nobody)])
        poller = select.poll()
        poller.register(udp.sock.fileno(), select.POLLERR)
        assert poller.poll(CEILING * 1000), "no ICMP error came back"
        # The error is pending now: the next send must not be the one that pays for it.
        udp.send_batch([(b"\x40to-a-listener", listener.getsockname())])
        assert listener.recv(100) == b"\x40to-a-listener"
        assert udp.take_refusals() == [nobody]
        assert udp.take_refusals() == []
        assert udp.receive_batch() == []
    finally:
        udp.close()
        listener.close()


def test_relayed_redials_in_a_row_over_one_registration(
    relayed_alice: tuple[Node, Node, str],
) -> None:
    """Twelve relayed sessions opened and closed one after another over the shared
    socket: each ends at the relay when it closes (the relay allows 8 open to one
    peer, and keeps a session it was not told of for far longer than this loop
    takes), and all go over the one registration."""
    alice, bob, relay = relayed_alice

    async def scenario() -> None:
        async with sharing_relayed(alice, bob) as agent:
            outgoing = OutgoingSocket(lambda: bob.home.identity)
            key = alice.home.identity.public_key
            try:
                for _ in range(12):
                    session = await open_session(
                        bob.home.identity, "bob", [], key, relays=[RelayHint(relay)], via=outgoing
                    )
                    try:
                        assert session.through_relay
                        assert isinstance(await session.request(Ping(sent=0.0)), Pong)
                    finally:
                        session.close()
                    # The provider holds a closed connection through QUIC's draining
                    # period (three probe timeouts, longer on a loaded machine) and
                    # counts it against max_links_per_peer (8) until then: wait for
                    # that, not for the relay, whose session must end at once.
                    async with asyncio.timeout(CEILING):
                        while agent._links:  # noqa: ASYNC110 (a provider's state, no event)
                            await asyncio.sleep(0.02)
                (state,) = outgoing.state().relays
                assert state.registrations == 1 and state.state.startswith("registered as")
            finally:
                outgoing.close()

    arun(scenario())
