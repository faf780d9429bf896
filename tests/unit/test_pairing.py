"""client/node pairing over real homes: a code pairs once, and pairing never lifts a denial.

Real node homes (keys, config, SQLite) and an injected clock; no network.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumesh.client.node import Node
from gpumesh.errors import ExpiredCodeError, PairingCodeError, PeerKeyChangedError
from gpumesh.identity.codes import make_code
from gpumesh.identity.keys import Identity

NOW = 1_700_000_000.0


def at(t: float) -> Any:
    return lambda: t


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[Callable[[str], Node]]:
    nodes: list[Node] = []

    def factory(name: str) -> Node:
        node = Node(tmp_path / name)
        node.init(name)
        node.home.config.set("listen_host", "127.0.0.1")
        node.home.config.set("listen_port", str(47000 + len(nodes)))
        node.home.config.save()
        nodes.append(node)
        return node

    yield factory
    for node in nodes:
        node.close()


def _move(node: Node, port: int, relay: str = "") -> None:
    """The node now listens elsewhere (and maybe uses a relay): its next code says so."""
    node.home.config.set("listen_port", str(port))
    if relay:
        node.home.config.set("relay", relay)
    node.home.config.save()


def test_a_code_pairs_once(make_node: Callable[[str], Node]) -> None:
    alice, bob = make_node("alice"), make_node("bob")
    code = bob.pairing_code(clock=at(NOW))
    assert alice.pair(code, clock=at(NOW)).allowed
    with pytest.raises(PairingCodeError, match="already used on this node") as info:
        alice.pair(code, clock=at(NOW + 60))
    assert "ask bob for a fresh code (`gpumesh pair-code` on their side)" in str(info.value)
    # Once expired it is refused as expired, as any old code is.
    with pytest.raises(ExpiredCodeError):
        alice.pair(code, clock=at(NOW + 3601))


def test_an_old_code_of_a_denied_peer_does_not_re_allow_it(
    make_node: Callable[[str], Node],
) -> None:
    alice, bob = make_node("alice"), make_node("bob")
    code = bob.pairing_code(clock=at(NOW))
    alice.pair(code, clock=at(NOW))
    alice.deny("bob")
    with pytest.raises(PairingCodeError, match="already used"):
        alice.pair(code, clock=at(NOW + 60))
    assert not alice.peer("bob").allowed


def test_a_denied_peers_fresh_code_keeps_it_denied_and_refreshes_its_hints(
    make_node: Callable[[str], Node],
) -> None:
    alice, bob = make_node("alice"), make_node("bob")
    alice.pair(bob.pairing_code(clock=at(NOW)), clock=at(NOW))
    alice.deny("bob")
    _move(bob, 47999, relay="relay.example:4799")
    peer = alice.pair(bob.pairing_code(clock=at(NOW + 60)), clock=at(NOW + 60))
    assert not peer.allowed
    assert peer.addresses == ["127.0.0.1:47999"]  # signed by the same key: safe to take
    assert peer.relay == "relay.example:4799"
    assert alice.home.store.allowed_keys([bob.home.identity.public_key]) == set()
    assert alice.allow("bob").allowed


def test_a_fresh_code_of_an_allowed_peer_refreshes_its_addresses(
    make_node: Callable[[str], Node],
) -> None:
    alice, bob = make_node("alice"), make_node("bob")
    alice.pair(bob.pairing_code(clock=at(NOW)), clock=at(NOW))
    _move(bob, 47999)
    peer = alice.pair(bob.pairing_code(clock=at(NOW + 60)), clock=at(NOW + 60))
    assert peer.allowed
    assert peer.addresses == ["127.0.0.1:47999"]
    assert [p.name for p in alice.peers()] == ["bob"]


def test_rekey_over_a_denied_name_keeps_the_name_denied(
    make_node: Callable[[str], Node],
) -> None:
    alice = make_node("alice")
    alice.pair(make_code(Identity.generate(), "bob", ["127.0.0.1:1"], clock=at(NOW)), clock=at(NOW))
    alice.deny("bob")
    reinstalled = make_code(Identity.generate(), "bob", ["127.0.0.1:2"], clock=at(NOW))
    with pytest.raises(PeerKeyChangedError, match="--rekey"):
        alice.pair(reinstalled, clock=at(NOW))
    # The refusal spent nothing: the same code goes through with --rekey.
    peer = alice.pair(reinstalled, rekey=True, clock=at(NOW))
    assert peer.addresses == ["127.0.0.1:2"]
    assert not peer.allowed
    assert [p.node_id for p in alice.peers()] == [peer.node_id]


def test_rekey_over_an_allowed_name_allows_the_new_key(make_node: Callable[[str], Node]) -> None:
    alice = make_node("alice")
    alice.pair(make_code(Identity.generate(), "bob", ["127.0.0.1:1"], clock=at(NOW)), clock=at(NOW))
    reinstalled = make_code(Identity.generate(), "bob", ["127.0.0.1:2"], clock=at(NOW))
    peer = alice.pair(reinstalled, rekey=True, clock=at(NOW))
    assert peer.allowed
    assert [p.node_id for p in alice.peers()] == [peer.node_id]


def test_a_denied_key_taking_another_name_stays_denied(make_node: Callable[[str], Node]) -> None:
    alice = make_node("alice")
    mallory = Identity.generate()
    alice.pair(make_code(mallory, "mallory", [], clock=at(NOW)), clock=at(NOW))
    alice.deny("mallory")
    # Renamed by its own signed code, and even over a paired name with --rekey: still denied.
    alice.pair(make_code(Identity.generate(), "bob", [], clock=at(NOW)), clock=at(NOW))
    peer = alice.pair(make_code(mallory, "bob", [], clock=at(NOW)), rekey=True, clock=at(NOW))
    assert peer.name == "bob"
    assert not peer.allowed
    assert [(p.name, p.allowed) for p in alice.peers()] == [("bob", False)]
