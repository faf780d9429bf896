"""Discovery among paired peers, without a registry: real agents over real QUIC.

alice knows bob and carol; carol moves to another port. carol's own sync
hands bob her new signed address record (she asked to be findable); alice's
sync then learns it from bob, checks it against the key she pinned for
carol, and reaches carol again. A bob that lies (a record for carol signed
by another key) is refused, and a node that did not opt in is never revealed.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gpumesh.agent.deps import RequestContext
from gpumesh.agent.server import Agent
from gpumesh.client.discovery import PeerRefresh, refresh_peers
from gpumesh.client.node import Node
from gpumesh.errors import ProtocolError
from gpumesh.identity.keys import Identity
from gpumesh.protocol.listing import DOMAIN, AddressRecord
from gpumesh.protocol.messages import AddressAnswer, AddressQuery, SignedAddresses
from gpumesh.protocol.peeraddresses import sign_own_record
from gpumesh.store.peerrecords import PeerRecords
from tests.integration.conftest import arun, gpumesh, pair_both, sharing
from tests.integration.test_cli import _free_udp_port, _init
from tests.integration.test_registry_share import _share, _stop

pytestmark = pytest.mark.usefixtures("gpumesh_processes")


def _three(make_node: Callable[[str], Node]) -> tuple[Node, Node, Node]:
    alice, bob, carol = make_node("alice"), make_node("bob"), make_node("carol")
    carol.home.config.set("announce_addresses", "true")
    carol.home.config.save()
    return alice, bob, carol


def _by_name(results: list[PeerRefresh]) -> dict[str, PeerRefresh]:
    return {result.name: result for result in results}


async def _ask(asker: Node, peer: str, message: AddressQuery) -> AddressAnswer:
    async with asker.session(peer) as session:
        reply = await session.request(message)
    assert isinstance(reply, AddressAnswer)
    return reply


def test_a_peer_that_moved_is_found_again_through_a_third_peer(
    make_node: Callable[[str], Node],
) -> None:
    alice, bob, carol = _three(make_node)

    async def scenario() -> None:
        async with sharing(bob):  # alice does not share: carol cannot tell her herself
            async with sharing(carol) as first:
                pair_both(alice, bob)
                pair_both(bob, carol)
                pair_both(alice, carol)
                old = f"127.0.0.1:{first.address[1]}"
                assert old in alice.peer("carol").addresses
            async with sharing(carol) as moved:
                new = f"127.0.0.1:{moved.address[1]}"
                assert new != old
                assert new not in alice.peer("carol").addresses
                # carol's sync tells bob where she is now.
                mine = _by_name(await refresh_peers(carol, None, timeout=3))
                assert mine["bob"].reachable is True and mine["alice"].reachable is False
                assert new in bob.peer("carol").addresses
                # alice no longer reaches carol at the old port; bob hands her on.
                synced = await asyncio.to_thread(gpumesh, alice.home.path, "sync", "--json")
                assert synced.returncode == 0, synced.stderr
                peers = {peer["name"]: peer for peer in json.loads(synced.stdout)["peers"]}
                assert peers["carol"]["moved"] is True
                assert peers["carol"]["found_via"] == "bob"
                assert peers["carol"]["reachable"] is True
                assert new in peers["carol"]["addresses"]
                assert peers["bob"]["reachable"] is True and peers["bob"]["moved"] is False
                # alice's next dial reaches carol at her new port.
                reached = await alice.connect("carol", pings=1, timeout=3)
                assert reached.address == new
                table = await asyncio.to_thread(gpumesh, alice.home.path, "sync")
                assert table.returncode == 0, table.stderr
                assert (
                    "No registry configured (rendezvous_url): refreshed from paired peers only."
                    in table.stdout
                )
                assert "PEER" in table.stdout and "REACHABLE" in table.stdout

    arun(scenario())


def _forging(agent: Agent, records: list[SignedAddresses]) -> None:
    """Make ``agent`` answer address queries with ``records`` as the handed-on ones
    (its own record is still its real one): a paired peer that lies."""
    real = agent.handlers[AddressQuery]

    async def lie(ctx: RequestContext, message: AddressQuery) -> None:
        class Capture:
            answer: AddressAnswer | None = None

            def send_message(self, answer: Any, end: bool = False) -> None:
                self.answer = answer

        capture = Capture()
        await real(RequestContext(ctx.peer, ctx.link, capture), message)  # type: ignore[arg-type]
        assert capture.answer is not None
        forged = msgspec.structs.replace(capture.answer, peers=records)
        ctx.stream.send_message(forged, end=True)

    agent.handlers[AddressQuery] = lie


def _signed_by(key: Identity, record: AddressRecord) -> SignedAddresses:
    body = msgspec.msgpack.encode(record)
    return SignedAddresses(record=body, signature=key.sign(DOMAIN + body))


def test_a_record_signed_by_another_key_is_refused_and_the_old_address_kept(
    make_node: Callable[[str], Node],
) -> None:
    alice, bob, carol = _three(make_node)
    mallory = Identity.generate()

    async def scenario() -> None:
        async with sharing(bob) as liar, sharing(carol):
            pair_both(alice, bob)
            pair_both(alice, carol)
            carol_key = carol.home.identity.public_key
            alice.home.store.save_peer(carol_key, "carol", ["127.0.0.1:9"], "")
            before = alice.peer("carol").addresses
            claims_carol = AddressRecord(
                public_key=carol_key, seq=2**60, timestamp=time.time(), addresses=["10.9.9.9:1"]
            )
            _forging(liar, [_signed_by(mallory, claims_carol)])
            results = _by_name(await refresh_peers(alice, None, timeout=2))
            assert results["carol"].moved is False
            assert results["carol"].reachable is False
            assert (
                "bob handed on an address record for it that was refused" in results["carol"].note
            )
            assert "does not verify" in results["carol"].note
            assert "kept its stored addresses" in results["carol"].note
            assert alice.peer("carol").addresses == before
            # A record signed by mallory for mallory herself: not a node alice asked about.
            _forging(liar, [sign_own_record(mallory, ["10.9.9.9:1"], "")])
            results = _by_name(await refresh_peers(alice, None, timeout=2))
            assert "a node not asked about" in results["bob"].note
            assert alice.peer("carol").addresses == before

    arun(scenario())


def test_a_node_that_did_not_opt_in_is_never_revealed(make_node: Callable[[str], Node]) -> None:
    alice, bob, carol = _three(make_node)
    carol.home.config.set("announce_addresses", "false")
    carol.home.config.save()
    carol_id = str(carol.home.identity.node_id)

    async def scenario() -> None:
        async with sharing(bob), sharing(carol):
            pair_both(alice, bob)
            pair_both(bob, carol)
            pair_both(alice, carol)
            # carol asks bob, and bob asks carol: bob holds carol's record second-hand.
            await refresh_peers(carol, None, timeout=2)
            await refresh_peers(bob, None, timeout=2)
            answer = await _ask(alice, "bob", AddressQuery(node_ids=[carol_id]))
            assert answer.peers == []
            assert answer.findable is False
            # Once carol opts in and syncs, bob hands her record on ...
            carol.home.config.set("announce_addresses", "true")
            await refresh_peers(carol, None, timeout=2)
            answer = await _ask(alice, "bob", AddressQuery(node_ids=[carol_id]))
            assert len(answer.peers) == 1
            # ... and after she opts out again and syncs, never again.
            carol.home.config.set("announce_addresses", "false")
            await refresh_peers(carol, None, timeout=2)
            answer = await _ask(alice, "bob", AddressQuery(node_ids=[carol_id]))
            assert answer.peers == []
            # Nor is a findable node revealed to a peer bob denied.
            carol.home.config.set("announce_addresses", "true")
            await refresh_peers(carol, None, timeout=2)
            bob.deny("carol")
            answer = await _ask(alice, "bob", AddressQuery(node_ids=[carol_id]))
            assert answer.peers == []

    arun(scenario())


def test_refusals_and_an_older_peer_are_one_line_notes(make_node: Callable[[str], Node]) -> None:
    alice, bob, _carol = _three(make_node)
    mallory = Identity.generate()

    async def scenario() -> None:
        async with sharing(bob) as older:
            pair_both(alice, bob)
            # An asker's "own" record signed by another key is refused, in one line.
            theirs = sign_own_record(mallory, ["10.9.9.9:1"], "")
            with pytest.raises(ProtocolError) as refused:
                await _ask(alice, "bob", AddressQuery(mine=theirs))
            assert refused.value.message.startswith(
                "your own address record was refused: the record is signed by another key"
            )
            assert "\n" not in refused.value.message
            assert str(mallory.node_id) not in {str(p.node_id) for p in bob.peers()}

            # A peer from before AddressQuery: sync says so and still dials it.
            async def unknown(ctx: RequestContext, message: AddressQuery) -> None:
                raise ProtocolError("AddressQuery is not a request this node serves")

            older.handlers[AddressQuery] = unknown
            (result,) = await refresh_peers(alice, None, timeout=2)
            assert result.reachable is True
            assert result.note == (
                "could not ask it for addresses: AddressQuery is not a request this node serves"
            )

    arun(scenario())


def test_share_with_announce_addresses_needs_no_registry(tmp_path: Path) -> None:
    alice, bob = tmp_path / "alice", tmp_path / "bob"
    _init(alice, "alice-pc", _free_udp_port())
    _init(bob, "bob-laptop")
    gpumesh(alice, "config", "set", "announce_addresses", "true")
    share = _share(alice)
    try:
        banner = share.banner  # type: ignore[attr-defined]
        assert "no rendezvous_url: paired peers hand this node's addresses on (`sync`)" in banner
        assert gpumesh(bob, "pair", gpumesh(alice, "pair-code").stdout.strip()).returncode == 0
        assert gpumesh(alice, "pair", gpumesh(bob, "pair-code").stdout.strip()).returncode == 0
        synced = gpumesh(bob, "sync", "--json")
        assert synced.returncode == 0, synced.stderr
        (peer,) = json.loads(synced.stdout)["peers"]
        assert peer["reachable"] is True and peer["note"] == ""
        # alice's record reached bob marked findable: bob may hand it on.
        stored = PeerRecords(bob).get(peer["node_id"])
        assert stored is not None and stored.findable is True
    finally:
        _stop(share)
