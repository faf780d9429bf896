"""The node process's shared dialling socket, in one process: real agents on
loopback, real QUIC. Links to two peers on one socket carry bulk at the same time,
each to its own peer (routed by connection id), and a re-dial leaves from the same
port."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gpumesh.client.node import Node
from gpumesh.client.pool import SessionPool
from gpumesh.transport.outgoing import OutgoingSocket
from tests.integration.conftest import arun, pair_both, sharing

SIZE = 8 * 1024 * 1024


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
