"""A node relaying for its peers, without I/O: the relay core's hooks and bounds
as such a node uses them (who may register, which pairs it joins, sessions in
all, one rate for every session, a deny ending sessions at both ends), the
share socket's routing between the relay it serves and the relays it uses,
and the ``relay_for_peers_rate`` setting."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from gpumesh.errors import ConfigError
from gpumesh.protocol import relay as wire
from gpumesh.protocol.addresses import Address
from gpumesh.protocol.relay import Close, Connect, Refused, Registered, encode_data, hello_packet
from gpumesh.protocol.relaycore import RelayCore
from gpumesh.store.config import KEYS, parse_rate
from gpumesh.transport.routes import Routes
from tests.unit.test_relay_core import SECRET, Node, Relay


class Friend(Relay):
    """The core as a node relaying for its peers: no allowlist, no token, not open;
    ``allowed`` stands for the keys it has paired and allowed."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(open=False, **settings)
        self.allowed: set[bytes] = set()
        counter = itertools.count(1)
        self.core = RelayCore(
            self.config,
            secret=SECRET,
            random_bytes=lambda n: next(counter).to_bytes(n, "big"),
            admit=lambda key: key in self.allowed,
            may_pair=self.may_pair,
        )

    def may_pair(self, a: bytes, b: bytes) -> bool:
        return a != b and a in self.allowed and b in self.allowed

    def peer(self) -> Node:
        node = self.node()
        self.allowed.add(node.key)
        return node


def test_only_a_paired_allowed_key_may_register() -> None:
    friend = Friend()
    stranger = friend.node()
    [(refused, _)] = friend.register(stranger)
    assert isinstance(refused, Refused) and refused.code == "not-allowed"
    [(registered, _)] = friend.register(friend.peer())
    assert isinstance(registered, Registered)


def test_a_session_joins_two_allowed_peers_only() -> None:
    friend = Friend()
    bob = friend.registered(friend.peer(), serving=False)
    alice = friend.registered(friend.peer())
    friend.allowed.discard(alice.key)  # denied after it registered
    [(refused, to)] = friend.say(Connect(request=1, peer=alice.key, candidates=[]), bob.address)
    assert to == bob.address
    assert isinstance(refused, Refused) and refused.code == "pair-not-allowed"
    assert "paired and allowed" in refused.message
    assert friend.core.session_count == 0


def test_sessions_past_the_bound_in_all_are_refused_relay_full() -> None:
    friend = Friend(max_sessions_total=1)
    bob = friend.registered(friend.peer(), serving=False)
    carol = friend.registered(friend.peer(), serving=False)
    alice = friend.registered(friend.peer())
    friend.open_session(bob, alice)
    [(refused, _)] = friend.say(Connect(request=9, peer=alice.key, candidates=[]), carol.address)
    assert isinstance(refused, Refused) and refused.code == "relay-full"
    assert "1 open" in refused.message and "limit is 1" in refused.message


def test_one_rate_bounds_every_session_together() -> None:
    rate = 30_000  # one bucket for all: 30 kB at once, then 30 kB a second
    friend = Friend(total_rate=rate)
    alice = friend.registered(friend.peer())
    bob = friend.registered(friend.peer(), serving=False)
    carol = friend.registered(friend.peer(), serving=False)
    first, _ = friend.open_session(bob, alice, request=1)
    second, _ = friend.open_session(carol, alice, request=2)
    sent = sum(len(friend.data(first, bytes(1000), bob.address)) for _ in range(20))
    sent += sum(len(friend.data(second, bytes(1000), carol.address)) for _ in range(20))
    assert sent == 30
    assert friend.data(second, bytes(1000), carol.address) == []  # dropped, not refused
    friend.now += 0.5
    sent = sum(len(friend.data(second, bytes(1000), carol.address)) for _ in range(40))
    assert sent == 15
    assert friend.core.session_count == 2


def test_dropping_a_key_ends_its_sessions_at_both_ends_and_tells_it() -> None:
    friend = Friend()
    bob = friend.registered(friend.peer(), serving=False)
    alice = friend.registered(friend.peer())
    session, _ = friend.open_session(bob, alice)
    friend.allowed.discard(bob.key)
    out = [(message, to) for message, to in _decoded(friend.core.drop_key(bob.key, friend.now))]
    closes = {to: m.code for m, to in out if isinstance(m, Close) and m.session == session}
    assert closes == {bob.address: "not-allowed", alice.address: "not-allowed"}
    assert any(isinstance(m, Refused) and to == bob.address for m, to in out)
    assert friend.core.session_count == 0
    assert friend.core.registered_keys() == [alice.key]
    assert all(to != bob.address for _, to in friend.data(session, b"x", alice.address))
    assert friend.core.stats(friend.now)["bytes_relayed"] == 0


def test_a_pair_no_longer_allowed_ends_at_both_ends() -> None:
    friend = Friend()
    bob = friend.registered(friend.peer(), serving=False)
    carol = friend.registered(friend.peer(), serving=False)
    alice = friend.registered(friend.peer())
    kept, _ = friend.open_session(carol, alice, request=1)
    ended, _ = friend.open_session(bob, alice, request=2)
    out = _decoded(friend.core.end_pairs(lambda a, b: bob.key not in (a, b), friend.now))
    assert {(m.session, to) for m, to in out} == {(ended, bob.address), (ended, alice.address)}
    assert friend.core.session_count == 1
    [(forwarded, to)] = friend.data(kept, b"payload", carol.address)
    assert to == alice.address and forwarded.endswith(b"payload")


def _decoded(out: list[tuple[bytes, Address]]) -> list[tuple[Any, Address]]:
    return [(wire.decode_packet(packet), to) for packet, to in out]


# --- the share socket's routes ----------------------------------------------------------------


class Recorder:
    """Stands for a relay client or the relay served: records what it is handed."""

    def __init__(self, sessions: frozenset[int] = frozenset()) -> None:
        self.sessions = sessions
        self.got: list[bytes] = []
        self.peer = ""

    def handle(self, packet: bytes, source: Address, now: float) -> None:
        self.got.append(packet)

    def holds(self, packet: bytes) -> bool:
        session, _ = wire.decode_data(packet)
        return session in self.sessions

    def close(self) -> None:
        pass


def test_routes_tell_the_relay_served_from_the_relays_used() -> None:
    routes = Routes()
    used, served = Recorder(frozenset({5})), Recorder()
    relay_address, peer_address = ("203.0.113.1", 47000), ("198.51.100.7", 47000)
    routes.clients[relay_address] = used  # type: ignore[assignment]
    routes.server = served
    hello = hello_packet()
    ours, theirs = encode_data(5, b"q"), encode_data(6, b"q")
    probe = wire.encode_packet(wire.Probe(session=5, tx=1, reply=False, mac=bytes(16)))
    close = wire.encode_packet(Close(session=6, code="closed", message=""))
    # The peer that is our relay registers with ours: its Hello is for the server.
    routes.handle(hello, relay_address, 0.0)
    routes.handle(ours, relay_address, 0.0)
    routes.handle(theirs, relay_address, 0.0)  # a session it relays through us
    routes.handle(probe, peer_address, 0.0)
    routes.handle(close, relay_address, 0.0)  # either may hold it: both see it
    routes.handle(hello, peer_address, 0.0)
    assert used.got == [ours, probe, close]
    assert served.got == [hello, theirs, close, hello]
    routes.server = None
    served.got.clear()
    assert routes.handle(hello, peer_address, 0.0) is None  # nobody's: dropped
    assert served.got == []


# --- the settings -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [("10MB/s", 10_000_000), ("500KB/s", 500_000), ("1GiB", 2**30), (" 2mb/S ", 2_000_000)],
)
def test_a_rate_is_bytes_a_second(text: str, expected: int) -> None:
    assert parse_rate(text) == expected


@pytest.mark.parametrize("text", ["fast", "0MB/s", "-1MB/s", "10MB/h", ""])
def test_a_bad_rate_says_what_to_give(text: str) -> None:
    with pytest.raises(ConfigError, match=r"invalid rate .*such as 10MB/s"):
        parse_rate(text)
    with pytest.raises(ConfigError):
        KEYS["relay_for_peers_rate"].parse(text)


def test_relaying_for_peers_is_off_by_default_and_bounded() -> None:
    assert KEYS["relay_for_peers"].default is False
    assert KEYS["relay_for_peers_sessions"].default == 8
    assert parse_rate(str(KEYS["relay_for_peers_rate"].default)) == 10_000_000
    with pytest.raises(ConfigError):
        KEYS["relay_for_peers_sessions"].parse("0")
