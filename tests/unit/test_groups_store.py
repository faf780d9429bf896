"""Groups in the store (migration 3, members, lookups) and client/groups over real homes.

The client tests use real node homes (keys, config, SQLite) and an injected
clock; nothing touches the network.
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumesh.client import groups as g
from gpumesh.client.node import Node
from gpumesh.errors import (
    ConfigError,
    ExpiredCodeError,
    NotFoundError,
    PairingCodeError,
    PeerError,
    UnknownPeerError,
)
from gpumesh.identity.codes import make_code
from gpumesh.identity.invites import (
    INVITE_PREFIX,
    InviteMember,
    make_invite,
    new_group_id,
    verify_invite,
)
from gpumesh.identity.keys import Identity, node_id_for
from gpumesh.store.db import MIGRATIONS, SCHEMA_VERSION, Store

NOW = 1_700_000_000.0


def key(n: int) -> bytes:
    return hashlib.sha256(b"member-key-%d" % n).digest()


def m(n: int, name: str, *addresses: str, relay: str = "") -> InviteMember:
    return InviteMember(name, key(n), list(addresses), relay)


def at(t: float) -> Any:
    return lambda: t


# --- schema -------------------------------------------------------------------


def test_migration_3_adds_groups_and_keeps_existing_data(tmp_path: Path) -> None:
    path = tmp_path / "gpumesh.db"
    raw = sqlite3.connect(path)
    for index in range(2):  # build a version-2 database the way older releases did
        raw.executescript(MIGRATIONS[index])
        raw.execute(f"PRAGMA user_version = {index + 1}")
    raw.execute(
        "INSERT INTO peers (node_id, name, public_key, paired_at) VALUES (?, ?, ?, ?)",
        (node_id_for(key(1)), "alice", key(1), NOW),
    )
    raw.commit()
    raw.close()

    store = Store(path)
    try:
        assert SCHEMA_VERSION >= 3
        assert store.schema_version == SCHEMA_VERSION
        assert [p.name for p in store.peers()] == ["alice"]
        assert store.groups() == []
        store.add_group(new_group_id(), "research", [m(1, "alice")])
        assert [grp.name for grp in store.groups()] == ["research"]
    finally:
        store.close()


# --- groups and members -------------------------------------------------------


def test_add_group_records_the_group_and_its_members(store: Store) -> None:
    group_id = new_group_id()
    group = store.add_group(
        group_id,
        "research",
        [m(1, "alice", "192.0.2.1:47000"), m(2, "bob", relay="relay:4799")],
        joined_via=node_id_for(key(1)),
        now=NOW,
    )
    assert group.group_id == group_id
    assert group.name == "research"
    assert group.created_at == NOW
    assert group.joined_via == node_id_for(key(1))
    assert group.member_count == 2
    assert group.short_id == group_id[:12]
    members = store.group_members(group_id)
    assert [x.name for x in members] == ["alice", "bob"]
    assert members[0].node_id == node_id_for(key(1))
    assert members[0].public_key == key(1)
    assert members[0].addresses == ["192.0.2.1:47000"]
    assert members[1].relay == "relay:4799"
    assert all(x.added_at == NOW and x.group_id == group_id for x in members)


def test_a_second_group_with_a_taken_name_is_refused_and_nothing_is_written(
    store: Store,
) -> None:
    first = store.add_group(new_group_id(), "research", [m(1, "alice")])
    with pytest.raises(ConfigError, match="a group named 'research' already exists") as info:
        store.add_group(new_group_id(), "research", [m(2, "bob"), m(3, "carol")])
    assert first.short_id in str(info.value)
    assert len(store.groups()) == 1
    assert [x.name for x in store.group_members(first.group_id)] == ["alice"]


def test_a_group_id_recorded_under_another_name_is_refused(store: Store) -> None:
    group_id = new_group_id()
    store.add_group(group_id, "research", [m(1, "alice")])
    with pytest.raises(ConfigError, match="already on this node as 'research'"):
        store.add_group(group_id, "other", [m(1, "alice")])


def test_saving_members_adds_new_ones_and_refreshes_known_ones(store: Store) -> None:
    group = store.add_group(new_group_id(), "research", [m(1, "alice", "192.0.2.1:1")], now=NOW)
    store.save_group_members(
        group.group_id,
        [m(1, "alice", "192.0.2.99:1", relay="r:1"), m(2, "bob")],
        now=NOW + 60,
    )
    members = {x.name: x for x in store.group_members(group.group_id)}
    assert set(members) == {"alice", "bob"}
    assert members["alice"].addresses == ["192.0.2.99:1"]
    assert members["alice"].relay == "r:1"
    assert members["alice"].added_at == NOW  # first sighting kept
    assert members["bob"].added_at == NOW + 60
    assert store.group_by_id(group.group_id).member_count == 2


def test_members_are_keyed_by_key_not_name(store: Store) -> None:
    group = store.add_group(new_group_id(), "research", [m(1, "alice")])
    store.save_group_members(group.group_id, [m(2, "alice"), m(1, "alice-renamed")])
    members = store.group_members(group.group_id)
    assert sorted((x.name, x.public_key) for x in members) == [
        ("alice", key(2)),
        ("alice-renamed", key(1)),
    ]


def test_a_paired_peer_can_be_saved_as_a_member(store: Store) -> None:
    peer = store.save_peer(key(7), "dave", ["192.0.2.7:47000"], "relay:1")
    group = store.add_group(new_group_id(), "research", [m(1, "alice")])
    store.save_group_members(group.group_id, [peer])
    dave = next(x for x in store.group_members(group.group_id) if x.name == "dave")
    assert dave.node_id == peer.node_id
    assert dave.addresses == ["192.0.2.7:47000"]
    assert dave.relay == "relay:1"


def test_members_who_are_paired_peers_keep_their_pairing_data(store: Store) -> None:
    peer = store.save_peer(key(7), "dave", ["192.0.2.7:47000"], "relay:1")
    group = store.add_group(new_group_id(), "research", [m(7, "mallory", "203.0.113.66:1")])
    store.save_group_members(group.group_id, [m(7, "evil", "203.0.113.66:2", relay="evil:1")])
    (dave,) = store.group_members(group.group_id)
    assert (dave.node_id, dave.name, dave.addresses, dave.relay) == (
        peer.node_id,
        "dave",
        ["192.0.2.7:47000"],
        "relay:1",
    )
    # Members it has not paired take what they are given.
    store.save_group_members(group.group_id, [m(8, "erin", "192.0.2.8:1")])
    erin = next(x for x in store.group_members(group.group_id) if x.public_key == key(8))
    assert (erin.name, erin.addresses) == ("erin", ["192.0.2.8:1"])


def test_saving_members_of_an_unknown_group_is_refused(store: Store) -> None:
    with pytest.raises(NotFoundError):
        store.save_group_members(new_group_id(), [m(1, "alice")])
    assert store.groups() == []


def test_groups_are_listed_by_name_with_member_counts(store: Store) -> None:
    store.add_group(new_group_id(), "zeta", [m(1, "a")])
    store.add_group(new_group_id(), "alpha", [m(1, "a"), m(2, "b"), m(3, "c")])
    assert [(x.name, x.member_count) for x in store.groups()] == [("alpha", 3), ("zeta", 1)]


def test_find_group_by_name_or_id_prefix(store: Store) -> None:
    group = store.add_group(new_group_id(), "research", [m(1, "a")])
    assert store.find_group("research") == group
    assert store.find_group(" research ") == group
    assert store.find_group(group.group_id[:4]) == group
    assert store.find_group(group.group_id.upper()) == group
    assert store.group_by_name("research") == group
    assert store.group_by_name("nope") is None


def test_find_group_refuses_unknown_short_and_ambiguous_queries(store: Store) -> None:
    store.add_group("aaaa" + "b" * 20, "one", [m(1, "a")])
    store.add_group("aaaa" + "c" * 20, "two", [m(1, "a")])
    with pytest.raises(NotFoundError, match="no group named 'nope'") as info:
        store.find_group("nope")
    assert "gpumesh group list" in str(info.value)
    with pytest.raises(NotFoundError, match="no group named 'aaa'"):
        store.find_group("aaa")  # under 4 characters: never a prefix
    with pytest.raises(NotFoundError, match="matches 2 groups"):
        store.find_group("aaaa")
    assert store.find_group("aaaab").name == "one"
    with pytest.raises(NotFoundError):
        store.group_by_id("b" * 24)


def test_group_state_is_shared_between_connections_and_survives_reopening(
    tmp_path: Path,
) -> None:
    path = tmp_path / "gpumesh.db"
    agent, cli = Store(path), Store(path)
    try:
        group = cli.add_group(new_group_id(), "research", [m(1, "alice")])
        cli.save_group_members(group.group_id, [m(2, "bob")])
        assert agent.find_group("research").member_count == 2
    finally:
        agent.close()
        cli.close()
    reopened = Store(path)
    try:
        assert [x.name for x in reopened.group_members(group.group_id)] == ["alice", "bob"]
    finally:
        reopened.close()


# --- client/groups over real homes --------------------------------------------


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


def _access(views: list[g.MemberView]) -> dict[str, str]:
    return {v.name: v.access for v in views}


def test_create_makes_this_node_the_only_member(make_node: Callable[[str], Node]) -> None:
    alice = make_node("alice")
    group = g.create_group(alice, "research", clock=at(NOW))
    assert group.created_at == NOW
    assert group.joined_via == ""
    (me,) = g.members(alice, "research")
    assert me.is_self
    assert me.access == g.ACCESS_SELF
    assert me.label == "this node"
    assert me.hint == ""
    assert me.member.public_key == alice.home.identity.public_key
    assert me.member.addresses == ["127.0.0.1:47000"]
    assert [x.name for x in g.groups(alice)] == ["research"]


def test_create_refuses_a_taken_name_and_bad_names(make_node: Callable[[str], Node]) -> None:
    alice = make_node("alice")
    g.create_group(alice, "research")
    with pytest.raises(ConfigError, match="already exists") as info:
        g.create_group(alice, "research")
    assert "gpumesh group invite research" in str(info.value)
    with pytest.raises(ConfigError, match="invalid group name"):
        g.create_group(alice, "two words")
    assert len(g.groups(alice)) == 1


def test_join_records_the_group_and_shows_pairing_state(
    make_node: Callable[[str], Node],
) -> None:
    alice, bob = make_node("alice"), make_node("bob")
    group = g.create_group(alice, "research")
    joined = g.join_group(bob, g.invite_code(alice, "research"))
    assert joined.group.group_id == group.group_id
    assert joined.group.name == "research"
    assert joined.group.joined_via == alice.home.identity.node_id
    assert joined.inviter == "alice"
    assert not joined.already_member
    assert _access(joined.members) == {"alice": "not paired", "bob": "self"}
    alice_view = next(v for v in joined.members if v.name == "alice")
    assert alice_view.peer is None
    assert alice_view.member.addresses == ["127.0.0.1:47000"]
    assert alice_view.hint == "not paired: ask for their `gpumesh pair-code`"
    (summary,) = g.summaries(bob)
    assert (summary.others, summary.usable, summary.inviter) == (1, 0, "alice")

    bob.pair(alice.pairing_code())
    assert _access(g.members(bob, "research")) == {"alice": "allowed", "bob": "self"}
    assert g.summaries(bob)[0].usable == 1
    bob.deny("alice")
    view = next(v for v in g.members(bob, "research") if v.name == "alice")
    assert view.access == "denied"
    assert view.peer is not None
    assert "gpumesh allow alice" in view.hint


def test_a_same_named_peer_with_another_key_is_flagged(make_node: Callable[[str], Node]) -> None:
    alice, bob = make_node("alice"), make_node("bob")
    g.create_group(alice, "research")
    g.join_group(bob, g.invite_code(alice, "research"))
    bob.pair(make_code(Identity.generate(), "alice", ["127.0.0.1:1"]))
    view = next(v for v in g.members(bob, "research") if v.name == "alice")
    assert view.access == g.ACCESS_KEY_DIFFERS
    assert view.peer is None
    assert "--rekey" in view.hint


def test_joining_again_refreshes_members(make_node: Callable[[str], Node]) -> None:
    alice, bob, carol = make_node("alice"), make_node("bob"), make_node("carol")
    g.create_group(alice, "research")
    g.join_group(bob, g.invite_code(alice, "research"))
    alice.pair(carol.pairing_code())
    g.add_member(alice, "research", "carol")
    again = g.join_group(bob, g.invite_code(alice, "research"))
    assert again.already_member
    assert _access(again.members) == {"alice": "not paired", "bob": "self", "carol": "not paired"}
    assert len(g.groups(bob)) == 1


def _forged(group_id: str, signer: Identity, *members: InviteMember) -> str:
    """An invite into ``group_id`` signed by a key of the forger's choosing."""
    listed = [InviteMember("mallory", signer.public_key, ["203.0.113.66:47000"], ""), *members]
    return make_invite(signer, group_id, "research", listed)


def _snapshot(node: Node, group: str) -> list[tuple[str, str, list[str], str]]:
    views = g.members(node, group)
    return [(v.member.node_id, v.name, v.member.addresses, v.member.relay) for v in views]


def test_an_invite_into_a_known_group_signed_by_a_stranger_is_refused(
    make_node: Callable[[str], Node],
) -> None:
    alice, bob, carol = make_node("alice"), make_node("bob"), make_node("carol")
    group = g.create_group(alice, "research")
    alice.pair(carol.pairing_code())
    g.add_member(alice, "research", "carol")
    g.join_group(bob, g.invite_code(alice, "research"))
    bob.pair(alice.pairing_code())
    before = _snapshot(bob, "research")
    peers_before = bob.peers()
    stranger = Identity.generate()
    forged = _forged(
        group.group_id,
        stranger,
        # Alice (paired) and carol (not paired) with the forger's addresses and names.
        InviteMember("alice-evil", alice.home.identity.public_key, ["203.0.113.66:1"], "evil:1"),
        InviteMember("carol-evil", carol.home.identity.public_key, ["203.0.113.66:2"], "evil:1"),
    )
    with pytest.raises(PairingCodeError) as info:
        g.join_group(bob, forged)
    message = str(info.value)
    assert f"that invite to group research ({group.short_id}) is signed by mallory" in message
    assert stranger.node_id.short in message
    assert "ask a member you know for an invite" in message
    assert "\n" not in message
    assert _snapshot(bob, "research") == before
    assert bob.peers() == peers_before


def test_a_known_members_invite_still_refreshes_the_group(
    make_node: Callable[[str], Node],
) -> None:
    alice, bob, carol = make_node("alice"), make_node("bob"), make_node("carol")
    g.create_group(alice, "research")
    alice.pair(carol.pairing_code())
    g.add_member(alice, "research", "carol")
    g.join_group(bob, g.invite_code(alice, "research"))
    # Carol (known to bob as a member, never paired) invites: her view refreshes bob's.
    g.join_group(carol, g.invite_code(alice, "research"))
    _move(carol, 47999)
    dave = make_node("dave")
    carol.pair(dave.pairing_code())
    g.add_member(carol, "research", "dave")
    again = g.join_group(bob, g.invite_code(carol, "research"))
    assert again.already_member
    assert again.inviter == "carol"
    assert _access(again.members) == {
        "alice": "not paired",
        "bob": "self",
        "carol": "not paired",
        "dave": "not paired",
    }
    carol_view = next(v for v in again.members if v.name == "carol")
    assert carol_view.member.addresses == ["127.0.0.1:47999"]


def test_invites_never_replace_a_paired_peers_name_addresses_or_relay(
    make_node: Callable[[str], Node],
) -> None:
    alice, bob, carol = make_node("alice"), make_node("bob"), make_node("carol")
    bob.pair(alice.pairing_code())
    alice_peer = bob.peer("alice")
    # A new group from anyone's invite: a paired member is recorded as bob paired it.
    stranger = Identity.generate()
    evil_alice = InviteMember(
        "alice-evil", alice.home.identity.public_key, ["203.0.113.66:1"], "e:1"
    )
    joined = g.join_group(bob, _forged(new_group_id(), stranger, evil_alice))
    view = next(v for v in joined.members if v.member.public_key == alice_peer.public_key)
    assert (view.name, view.member.addresses, view.member.relay) == (
        "alice",
        alice_peer.addresses,
        alice_peer.relay,
    )
    # A known group, refreshed by a real member whose view of alice is wrong or stale.
    g.create_group(carol, "lab")
    carol.home.store.save_group_members(g.find_group(carol, "lab").group_id, [evil_alice])
    g.join_group(bob, g.invite_code(carol, "lab"))
    g.join_group(bob, g.invite_code(carol, "lab"))
    view = next(v for v in g.members(bob, "lab") if v.member.public_key == alice_peer.public_key)
    assert (view.name, view.member.addresses, view.member.relay) == (
        "alice",
        alice_peer.addresses,
        alice_peer.relay,
    )
    assert bob.peer("alice") == alice_peer  # the pairing itself is never touched


def test_the_inviter_is_named_as_this_node_paired_it(make_node: Callable[[str], Node]) -> None:
    alice, bob = make_node("alice"), make_node("bob")
    g.create_group(alice, "research")
    bob.pair(alice.pairing_code())
    alice.home.config.set("node_name", "alice-renamed")
    alice.home.config.save()
    joined = g.join_group(bob, g.invite_code(alice, "research"))
    assert joined.inviter == "alice"
    assert g.summaries(bob)[0].inviter == "alice"


def _move(node: Node, port: int) -> None:
    node.home.config.set("listen_port", str(port))
    node.home.config.save()


def test_a_member_invites_a_third_node_with_everyone_in_it(
    make_node: Callable[[str], Node],
) -> None:
    alice, bob, carol = make_node("alice"), make_node("bob"), make_node("carol")
    g.create_group(alice, "research")
    g.join_group(bob, g.invite_code(alice, "research"))
    joined = g.join_group(carol, g.invite_code(bob, "research"))
    assert joined.inviter == "bob"
    assert _access(joined.members) == {
        "alice": "not paired",
        "bob": "not paired",
        "carol": "self",
    }
    assert joined.group.joined_via == bob.home.identity.node_id


def test_the_invite_carries_paired_peers_freshest_addresses(
    make_node: Callable[[str], Node],
) -> None:
    alice, bob = make_node("alice"), make_node("bob")
    group = g.create_group(alice, "research")
    peer = alice.pair(bob.pairing_code())
    g.add_member(alice, "research", "bob")
    alice.home.store.touch_peer(peer.node_id, address="192.0.2.50:47001")
    invite = verify_invite(g.invite_code(alice, "research", clock=at(NOW)), clock=at(NOW))
    assert invite.group_id == group.group_id
    by_name = {x.name: x for x in invite.members}
    assert by_name["bob"].addresses[0] == "192.0.2.50:47001"
    assert by_name["alice"].public_key == alice.home.identity.public_key
    assert invite.expires == NOW + 24 * 3600


def test_invite_lifetime_is_bounded(make_node: Callable[[str], Node]) -> None:
    alice = make_node("alice")
    g.create_group(alice, "research")
    for lifetime in (0, -5, 8 * 86400):
        with pytest.raises(ConfigError, match="at most 7d"):
            g.invite_code(alice, "research", lifetime=lifetime)
    code = g.invite_code(alice, "research", lifetime=3600, clock=at(NOW))
    assert code.startswith(INVITE_PREFIX)
    assert verify_invite(code, clock=at(NOW)).expires == NOW + 3600


def test_join_refuses_expired_own_and_conflicting_invites(
    make_node: Callable[[str], Node],
) -> None:
    alice, bob = make_node("alice"), make_node("bob")
    g.create_group(alice, "research")
    code = g.invite_code(alice, "research", clock=at(NOW))
    with pytest.raises(ExpiredCodeError, match="expired 1h ago"):
        g.join_group(bob, code, clock=at(NOW + 25 * 3600))
    with pytest.raises(PeerError, match="this node's own invite"):
        g.join_group(alice, g.invite_code(alice, "research"))
    g.create_group(bob, "research")
    with pytest.raises(ConfigError, match="already has a different group named 'research'"):
        g.join_group(bob, g.invite_code(alice, "research"))
    with pytest.raises(PairingCodeError, match="pairing code, not a group invite"):
        g.join_group(bob, alice.pairing_code())
    assert [x.member_count for x in g.groups(bob)] == [1]


def test_add_needs_a_paired_peer(make_node: Callable[[str], Node]) -> None:
    alice, bob = make_node("alice"), make_node("bob")
    g.create_group(alice, "research")
    with pytest.raises(UnknownPeerError, match="no paired peer named 'bob'") as info:
        g.add_member(alice, "research", "bob")
    assert "gpumesh group invite research" in str(info.value)
    peer = alice.pair(bob.pairing_code())
    added = g.add_member(alice, "research", peer.node_id[:8], clock=at(NOW))
    assert not added.already_member
    assert added.member.name == "bob"
    assert added.member.access == "allowed"
    assert added.member.member.added_at == NOW
    assert added.group.member_count == 2
    assert g.add_member(alice, "research", "bob").already_member


def test_unknown_groups_are_refused_everywhere(make_node: Callable[[str], Node]) -> None:
    alice = make_node("alice")
    for call in (
        lambda: g.members(alice, "nope"),
        lambda: g.invite_code(alice, "nope"),
        lambda: g.add_member(alice, "nope", "bob"),
        lambda: g.find_group(alice, "nope"),
    ):
        with pytest.raises(NotFoundError, match="no group named 'nope'"):
            call()
