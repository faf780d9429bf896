"""protocol/relaycore: registration, sessions, forwarding rules and limits, with no
sockets and a fake clock. Each test drives :class:`RelayCore` with the same
packets a node would send and checks what comes out, and to whom."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumesh.errors import ConfigError
from gpumesh.identity.keys import Identity, NodeId, node_id_for
from gpumesh.protocol import relay as wire
from gpumesh.protocol.addresses import Address
from gpumesh.protocol.relay import (
    HELLO_MIN_SIZE,
    MAX_PACKET,
    REFUSALS,
    Accept,
    Challenge,
    Close,
    Connect,
    Connected,
    Decline,
    Hello,
    Incoming,
    KeepAlive,
    KeepAliveAck,
    ReachProbe,
    ReachTest,
    Refused,
    Register,
    Registered,
    RelayMessage,
    challenge_nonce,
    decode_data,
    decode_packet,
    encode_data,
    encode_packet,
    hello_packet,
    is_data,
    keepalive_packet,
    register_payload,
    token_proof,
)
from gpumesh.protocol.relaycore import RelayCore, Send, address_text, is_reach_probe
from gpumesh.relay import config as relay_config
from gpumesh.relay.config import (
    RelayConfig,
    load_config_file,
    parse_listen,
    read_allow_file,
)
from gpumesh.units import parse_duration

SECRET = b"s" * 32
START = 1_000_000.0  # an epoch boundary (30 s buckets)


@dataclass
class Node:
    identity: Identity
    address: Address

    @property
    def key(self) -> bytes:
        return self.identity.public_key

    @property
    def node_id(self) -> NodeId:
        return node_id_for(self.key)


class Relay:
    """A core with a fake clock, and helpers that speak for nodes."""

    def __init__(self, **settings: Any) -> None:
        settings.setdefault("open", True)
        self.config = RelayConfig(**settings)
        counter = itertools.count(1)
        self.core = RelayCore(
            self.config,
            secret=SECRET,
            random_bytes=lambda n: next(counter).to_bytes(n, "big"),
        )
        self.now = START
        self._hosts = itertools.count(1)

    def node(self, host: str | None = None, port: int = 40000) -> Node:
        return Node(Identity.generate(), (host or f"198.51.100.{next(self._hosts)}", port))

    def send(self, packet: bytes, source: Address) -> list[Send]:
        return self.core.handle(packet, source, self.now)

    def say(self, message: RelayMessage, source: Address) -> list[tuple[Any, Address]]:
        return decoded(self.send(encode_packet(message), source))

    def tick(self, seconds: float) -> list[tuple[Any, Address]]:
        self.now += seconds
        return decoded(self.core.tick(self.now))

    def challenge(self, address: Address) -> bytes:
        [(reply, to)] = decoded(self.send(hello_packet(), address))
        assert isinstance(reply, Challenge) and to == address
        return reply.nonce

    def register(
        self, node: Node, *, serving: bool = True, token: str = ""
    ) -> list[tuple[Any, Address]]:
        nonce = self.challenge(node.address)
        return self.say(registration(node, nonce, serving=serving, token=token), node.address)

    def registered(self, node: Node, *, serving: bool = True) -> Node:
        [(reply, _)] = self.register(node, serving=serving)
        assert isinstance(reply, Registered), reply
        return node

    def open_session(
        self, requester: Node, server: Node, request: int = 7
    ) -> tuple[int, list[tuple[Any, Address]]]:
        [(incoming, to)] = self.say(
            Connect(request=request, peer=server.key, candidates=["10.0.0.2:47000"]),
            requester.address,
        )
        assert isinstance(incoming, Incoming) and to == server.address
        out = self.say(Accept(session=incoming.session, candidates=["10.0.0.3:47000"]), to)
        return incoming.session, out

    def data(self, session: int, payload: bytes, source: Address) -> list[Send]:
        return self.send(encode_data(session, payload), source)


def registration(node: Node, nonce: bytes, *, serving: bool = True, token: str = "") -> Register:
    signature = node.identity.sign(register_payload(nonce, node.key, serving))
    return Register(
        public_key=node.key,
        nonce=nonce,
        signature=signature,
        token_proof=token_proof(token, nonce),
        serving=serving,
    )


def decoded(out: list[Send]) -> list[tuple[Any, Address]]:
    result: list[tuple[Any, Address]] = []
    for packet, address in out:
        message: Any = decode_data(packet) if is_data(packet) else decode_packet(packet)
        result.append((message, address))
    return result


def only(out: list[tuple[Any, Address]]) -> Any:
    assert len(out) == 1, out
    return out[0][0]


# --- challenge and registration ---------------------------------------------------------------


def test_a_padded_hello_gets_a_stateless_challenge_and_a_short_one_nothing() -> None:
    relay = Relay()
    address = ("203.0.113.5", 5000)
    short = encode_packet(Hello())
    assert len(short) < HELLO_MIN_SIZE
    assert relay.send(short, address) == []
    [(challenge, to)] = decoded(relay.send(hello_packet(), address))
    assert to == address
    assert challenge.observed == "203.0.113.5:5000"
    assert challenge.nonce == challenge_nonce(SECRET, "203.0.113.5:5000", int(START // 30))
    assert relay.core.registration_count == 0
    assert relay.core.stats(relay.now)["registrations"] == 0


def test_registration_is_accepted_with_the_relay_limits() -> None:
    relay = Relay(keepalive=12.0, session_bytes=5000, session_seconds=60.0)
    node = relay.node()
    registered = only(relay.register(node))
    assert registered == Registered(
        observed=address_text(node.address),
        keepalive=12.0,
        session_bytes=5000,
        session_seconds=60.0,
    )
    assert relay.core.is_registered(node.address)


def test_a_nonce_from_the_previous_epoch_works_and_an_older_one_is_bad() -> None:
    relay = Relay()
    node = relay.node()
    nonce = relay.challenge(node.address)
    relay.now += 30  # next epoch: still fine
    assert isinstance(only(relay.say(registration(node, nonce), node.address)), Registered)
    late = relay.node()
    nonce = relay.challenge(late.address)
    relay.now += 60  # two epochs on
    refused = only(relay.say(registration(late, nonce), late.address))
    assert refused.code == "bad-nonce"
    assert not relay.core.is_registered(late.address)


def test_a_nonce_made_for_another_address_is_bad() -> None:
    relay = Relay()
    victim, attacker = relay.node(), relay.node()
    nonce = relay.challenge(victim.address)
    refused = only(relay.say(registration(attacker, nonce), attacker.address))
    assert refused.code == "bad-nonce"


def test_another_relay_secret_makes_other_nonces() -> None:
    relay = Relay()
    node = relay.node()
    foreign = challenge_nonce(b"x" * 32, address_text(node.address), int(START // 30))
    assert only(relay.say(registration(node, foreign), node.address)).code == "bad-nonce"


def test_a_bad_signature_is_refused() -> None:
    relay = Relay()
    node, thief = relay.node(), relay.node()
    nonce = relay.challenge(node.address)
    forged = registration(thief, nonce)  # signed by another key
    message = Register(
        public_key=node.key,
        nonce=nonce,
        signature=forged.signature,
        token_proof=b"",
        serving=True,
    )
    assert only(relay.say(message, node.address)).code == "bad-signature"
    # The role is signed too: flipping serving breaks the signature.
    good = registration(node, nonce, serving=False)
    flipped = Register(
        public_key=good.public_key,
        nonce=nonce,
        signature=good.signature,
        token_proof=b"",
        serving=True,
    )
    assert only(relay.say(flipped, node.address)).code == "bad-signature"
    assert relay.core.registration_count == 0


def test_private_relay_admits_allowlisted_nodes_only() -> None:
    friend = Node(Identity.generate(), ("198.51.100.10", 1))
    relay = Relay(open=False, allow=frozenset({friend.node_id}))
    stranger = relay.node()
    assert isinstance(only(relay.register(friend)), Registered)
    refused = only(relay.register(stranger))
    assert refused == Refused(code="not-allowed", message=REFUSALS["not-allowed"])
    assert relay.core.stats(relay.now)["refusals"] == {"not-allowed": 1}


def test_token_proof_admits_and_a_wrong_token_does_not() -> None:
    relay = Relay(open=False, tokens=("old-token", "s3cret"))
    assert isinstance(only(relay.register(relay.node(), token="s3cret")), Registered)
    assert isinstance(only(relay.register(relay.node(), token="old-token")), Registered)
    assert only(relay.register(relay.node(), token="guess")).code == "not-allowed"
    assert only(relay.register(relay.node())).code == "not-allowed"


def test_a_proof_for_another_nonce_does_not_pass() -> None:
    relay = Relay(open=False, tokens=("s3cret",))
    node = relay.node()
    nonce = relay.challenge(node.address)
    signed = registration(node, nonce)
    replayed = Register(
        public_key=node.key,
        nonce=nonce,
        signature=signed.signature,
        token_proof=token_proof("s3cret", b"\0" * 32),
        serving=True,
    )
    assert only(relay.say(replayed, node.address)).code == "not-allowed"


def test_total_and_per_ip_limits() -> None:
    relay = Relay(max_registrations=3, max_per_ip=2)
    a = relay.registered(relay.node("192.0.2.1", 1))
    relay.registered(relay.node("192.0.2.1", 2))
    assert only(relay.register(relay.node("192.0.2.1", 3))).code == "too-many-per-ip"
    relay.registered(relay.node("192.0.2.2", 1))
    assert only(relay.register(relay.node("192.0.2.3", 1))).code == "too-many-registrations"
    # Registering again from a known address replaces, and needs no room.
    relay.registered(a)
    assert relay.core.registration_count == 3


def test_one_key_may_register_from_several_addresses() -> None:
    relay = Relay()
    sharer = relay.registered(relay.node("192.0.2.1", 47000))
    dialer = Node(sharer.identity, ("192.0.2.1", 51000))
    relay.registered(dialer, serving=False)
    assert relay.core.registration_count == 2


def test_keepalive_acks_say_whether_the_address_is_registered() -> None:
    relay = Relay()
    node = relay.registered(relay.node())
    ack = only(relay.say(KeepAlive(seq=4), node.address))
    assert ack == KeepAliveAck(seq=4, registered=True, observed=address_text(node.address))
    stranger = ("192.0.2.99", 9)
    assert relay.say(KeepAlive(seq=5), stranger) == []  # unpadded: the answer would be larger
    assert only(decoded(relay.send(keepalive_packet(5), stranger))).registered is False


def test_after_a_restart_keepalives_say_register_again() -> None:
    relay = Relay()
    node = relay.registered(relay.node())
    restarted = Relay()  # a new process: new state, new secret in real life
    assert only(decoded(restarted.send(keepalive_packet(1), node.address))).registered is False
    assert only(decoded(relay.send(keepalive_packet(1), node.address))).registered is True


def test_silent_registrations_expire_and_anything_keeps_them() -> None:
    relay = Relay(registration_timeout=45.0)
    quiet, chatty = relay.registered(relay.node()), relay.registered(relay.node())
    for _ in range(4):
        relay.tick(20)
        relay.say(KeepAlive(seq=1), chatty.address)
    assert not relay.core.is_registered(quiet.address)
    assert relay.core.is_registered(chatty.address)


def test_reach_test_is_answered_from_the_probe_port() -> None:
    relay = Relay()
    address = ("192.0.2.8", 8)
    [(packet, to)] = relay.send(encode_packet(ReachTest(seq=3)), address)
    assert is_reach_probe(packet) and to == address
    assert decode_packet(packet) == ReachProbe(seq=3)
    assert relay.send(encode_packet(ReachTest(seq=4)), address) == []  # throttled
    relay.now += 1
    assert len(relay.send(encode_packet(ReachTest(seq=5)), address)) == 1
    assert not is_reach_probe(hello_packet())


def test_the_probe_port_answers_a_padded_hello_and_nothing_else() -> None:
    """The second port: a Challenge naming the address seen from there (a NAT that
    maps by destination shows another one), and every Challenge names that port."""
    relay = Relay()
    relay.core.probe_port = 4800
    address = ("192.0.2.9", 9)
    [(main, _)] = decoded(relay.send(hello_packet(), address))
    [(packet, to)] = relay.core.handle_probe_port(hello_packet(), address, relay.now)
    second = decode_packet(packet)
    assert to == address and isinstance(second, Challenge)
    assert (
        main
        == second
        == Challenge(
            nonce=challenge_nonce(SECRET, "192.0.2.9:9", int(START // 30)),
            observed="192.0.2.9:9",
            probe_port=4800,
        )
    )
    big = encode_packet(Hello(padding=bytes(1400)))  # a path MTU probe
    assert len(relay.core.handle_probe_port(big, address, relay.now)) == 1
    assert len(relay.send(big, address)) == 1
    node = relay.node()
    nonce = relay.challenge(node.address)
    ignored = [
        encode_packet(Hello()),
        encode_packet(Hello(padding=bytes(MAX_PACKET))),  # past MAX_PACKET with its header
        encode_packet(ReachTest(seq=1)),
        keepalive_packet(1),
        encode_packet(registration(node, nonce)),
        encode_packet(Connect(request=1, peer=node.key, candidates=[])),
        encode_data(1, bytes(200)),
        bytes((Hello.TYPE,)) + b"GM\x01" + bytes(200),
        bytes(200),
    ]
    for packet in ignored:
        assert relay.core.handle_probe_port(packet, node.address, relay.now) == [], packet[:8]
    assert not relay.core.is_registered(node.address)
    assert relay.core.registration_count == 0


def test_probe_port_is_a_trailing_field_both_sides_of_an_upgrade_read() -> None:
    """An older relay's Challenge (without it) decodes with 0; an older node's decoder
    (without the field) reads a new relay's Challenge, its extra item ignored."""
    old = b"\x02GM\x01" + msgspec.msgpack.encode([bytes(32), "192.0.2.1:5"])
    assert decode_packet(old) == Challenge(nonce=bytes(32), observed="192.0.2.1:5")
    assert decode_packet(old).probe_port == 0

    class OlderChallenge(msgspec.Struct, frozen=True, array_like=True):
        nonce: bytes
        observed: str

    new = encode_packet(Challenge(nonce=bytes(32), observed="192.0.2.1:5", probe_port=4800))
    older = msgspec.msgpack.Decoder(OlderChallenge).decode(new[4:])
    assert older == OlderChallenge(nonce=bytes(32), observed="192.0.2.1:5")


# --- sessions ---------------------------------------------------------------------------------


def test_connect_accept_and_data_both_ways() -> None:
    relay = Relay()
    server = relay.registered(relay.node())
    requester = relay.registered(relay.node(), serving=False)
    [(incoming, to)] = relay.say(
        Connect(request=7, peer=server.key, candidates=["10.0.0.2:5"]), requester.address
    )
    assert to == server.address
    assert incoming.peer == requester.key
    assert incoming.observed == address_text(requester.address)
    assert incoming.candidates == ["10.0.0.2:5"]
    assert len(incoming.secret) == 16
    assert 0 < incoming.session < 2**63
    [(connected, to)] = relay.say(
        Accept(session=incoming.session, candidates=["10.0.0.3:6"]), server.address
    )
    assert to == requester.address
    assert connected == Connected(
        request=7,
        session=incoming.session,
        observed=address_text(server.address),
        candidates=["10.0.0.3:6"],
        secret=incoming.secret,
    )
    session = incoming.session
    packet = encode_data(session, b"\xc0quic bytes")
    assert relay.send(packet, requester.address) == [(packet, server.address)]
    back = encode_data(session, b"\x40reply")
    assert relay.send(back, server.address) == [(back, requester.address)]
    stats = relay.core.stats(relay.now)
    assert stats["sessions_opened"] == 1
    assert stats["bytes_relayed"] == len(b"\xc0quic bytes") + len(b"\x40reply")
    [entry] = stats["sessions"]
    assert entry["a"] == requester.node_id and entry["b"] == server.node_id
    assert entry["state"] == "active" and entry["id"] == session


def test_connect_to_an_unknown_or_non_serving_peer_is_refused() -> None:
    relay = Relay()
    requester = relay.registered(relay.node(), serving=False)
    dialer_only = relay.registered(relay.node(), serving=False)
    for peer in (Identity.generate().public_key, dialer_only.key):
        refused = only(relay.say(Connect(request=9, peer=peer, candidates=[]), requester.address))
        assert (refused.code, refused.session) == ("unknown-peer", 9)
    assert relay.core.session_count == 0


def test_connect_from_an_unregistered_address_is_refused() -> None:
    relay = Relay()
    server = relay.registered(relay.node())
    refused = only(relay.say(Connect(request=3, peer=server.key, candidates=[]), ("192.0.2.9", 1)))
    assert (refused.code, refused.session) == ("not-registered", 3)


def test_the_newest_serving_registration_of_a_key_gets_the_session() -> None:
    relay = Relay()
    old = relay.registered(relay.node("192.0.2.1", 1000))
    relay.now += 5
    new = relay.registered(Node(old.identity, ("192.0.2.1", 2000)))
    relay.registered(Node(old.identity, ("192.0.2.1", 3000)), serving=False)
    requester = relay.registered(relay.node(), serving=False)
    [(_, to)] = relay.say(Connect(request=1, peer=old.key, candidates=[]), requester.address)
    assert to == new.address


def test_a_duplicate_connect_opens_no_second_session() -> None:
    relay = Relay()
    server = relay.registered(relay.node())
    requester = relay.registered(relay.node(), serving=False)
    connect = Connect(request=11, peer=server.key, candidates=[])
    first = only(relay.say(connect, requester.address))
    again = only(relay.say(connect, requester.address))
    assert again == first  # the same Incoming, to the server again
    assert relay.core.session_count == 1
    connected = only(relay.say(Accept(session=first.session, candidates=[]), server.address))
    assert only(relay.say(connect, requester.address)) == connected
    assert relay.core.session_count == 1
    # A new request id is a new session.
    other = only(relay.say(Connect(request=12, peer=server.key, candidates=[]), requester.address))
    assert other.session != first.session and relay.core.session_count == 2


def test_decline_and_silence_refuse_the_requester() -> None:
    relay = Relay(connect_timeout=5.0)
    server = relay.registered(relay.node())
    requester = relay.registered(relay.node(), serving=False)
    incoming = only(
        relay.say(Connect(request=1, peer=server.key, candidates=[]), requester.address)
    )
    [(refused, to)] = relay.say(Decline(session=incoming.session), server.address)
    assert (refused.code, refused.session, to) == ("peer-declined", 1, requester.address)
    assert relay.core.session_count == 0
    only(relay.say(Connect(request=2, peer=server.key, candidates=[]), requester.address))
    assert relay.tick(4.9) == []
    [(refused, to)] = relay.tick(0.2)
    assert (refused.code, refused.session, to) == ("unknown-peer", 2, requester.address)
    assert relay.core.session_count == 0


def test_only_the_serving_end_may_accept() -> None:
    relay = Relay()
    server = relay.registered(relay.node())
    requester = relay.registered(relay.node(), serving=False)
    intruder = relay.registered(relay.node())
    incoming = only(
        relay.say(Connect(request=1, peer=server.key, candidates=[]), requester.address)
    )
    for who in (intruder, requester):
        relay.now += 1
        refused = only(relay.say(Accept(session=incoming.session, candidates=[]), who.address))
        assert refused.code == "no-session"
    assert relay.core.stats(relay.now)["sessions"][0]["state"] == "pending"


def test_per_node_session_limit() -> None:
    relay = Relay(max_sessions=2, max_sessions_per_pair=1)
    servers = [relay.registered(relay.node()) for _ in range(3)]
    requester = relay.registered(relay.node(), serving=False)
    for request, server in enumerate(servers[:2], start=1):
        relay.open_session(requester, server, request)
    connect = Connect(request=3, peer=servers[2].key, candidates=[])
    refused = only(relay.say(connect, requester.address))
    assert (refused.code, refused.session) == ("too-many-sessions", 3)
    assert refused.message == REFUSALS["too-many-sessions"] + " (2 open; the relay's limit is 2)"
    # The limit is the serving node's too: once two others fill it, a third cannot get in.
    for request in (1, 2):
        relay.open_session(relay.registered(relay.node(), serving=False), servers[2], request)
    fresh = relay.registered(relay.node(), serving=False)
    refused = only(relay.say(Connect(request=1, peer=servers[2].key, candidates=[]), fresh.address))
    assert refused.code == "peer-too-many-sessions"


def test_one_node_cannot_take_all_of_anothers_sessions() -> None:
    relay = Relay(max_sessions=4, max_sessions_initiated=3, max_sessions_per_pair=2)
    c = relay.registered(relay.node())
    a = relay.registered(relay.node(), serving=False)
    b = relay.registered(relay.node(), serving=False)
    first, _ = relay.open_session(a, c, 1)
    only(relay.say(Connect(request=2, peer=c.key, candidates=[]), a.address))  # pending counts
    refused = only(relay.say(Connect(request=3, peer=c.key, candidates=[]), a.address))
    assert (refused.code, refused.session) == ("too-many-to-peer", 3)
    assert refused.message == REFUSALS["too-many-to-peer"] + " (2 open; the relay's limit is 2)"
    # c has room left, and a cannot take it: b still gets through.
    relay.open_session(b, c, 1)
    # A slot a gave back is a's to use again.
    relay.say(Close(session=first, code="closed", message=""), a.address)
    relay.open_session(a, c, 4)
    assert relay.core.stats(relay.now)["refusals"] == {"too-many-to-peer": 1}


def test_a_node_may_ask_for_only_so_many_sessions_at_once() -> None:
    relay = Relay(max_sessions=4, max_sessions_initiated=2, max_sessions_per_pair=1)
    a = relay.registered(relay.node())
    b = relay.registered(relay.node(), serving=False)
    peers = [relay.registered(relay.node()) for _ in range(3)]
    relay.open_session(a, peers[0], 1)
    relay.open_session(a, peers[1], 2)
    refused = only(relay.say(Connect(request=3, peer=peers[2].key, candidates=[]), a.address))
    assert (refused.code, refused.session) == ("too-many-initiated", 3)
    assert refused.message == REFUSALS["too-many-initiated"] + " (2 open; the relay's limit is 2)"
    # Others still reach the peer a could not, and a itself: sessions a did not ask
    # for are not a's quota.
    relay.open_session(b, peers[2], 1)
    relay.open_session(b, a, 2)
    assert relay.core.session_count == 4


# --- forwarding rules -------------------------------------------------------------------------


def test_a_third_node_cannot_inject_into_a_session() -> None:
    relay = Relay()
    server = relay.registered(relay.node())
    requester = relay.registered(relay.node(), serving=False)
    intruder = relay.registered(relay.node())
    session, _ = relay.open_session(requester, server)
    [(refused, to)] = decoded(relay.data(session, b"evil", intruder.address))
    assert (refused.code, refused.session, to) == ("no-session", session, intruder.address)
    assert relay.data(session, b"evil", intruder.address) == []  # one refusal a second
    relay.now += 1.0
    [(refused, to)] = decoded(relay.data(session, b"evil", intruder.address))
    assert to == intruder.address
    assert relay.core.stats(relay.now)["bytes_relayed"] == 0


def test_an_unregistered_source_is_refused_and_nothing_is_forwarded() -> None:
    relay = Relay()
    server = relay.registered(relay.node())
    requester = relay.registered(relay.node(), serving=False)
    session, _ = relay.open_session(requester, server)
    spoofer = ("192.0.2.66", 6666)
    datagram = b"\x40" + bytes(40)  # the smallest QUIC packets are about this size
    [(refused, to)] = decoded(relay.data(session, datagram, spoofer))
    assert (refused.code, refused.message, to) == ("not-registered", "", spoofer)
    for _ in range(10):
        assert relay.data(session, datagram, spoofer) == []
    # Same port at the requester's IP is still another address.
    [(_, to)] = relay.data(session, datagram, (requester.address[0], 1))
    assert to != server.address
    assert relay.core.stats(relay.now)["bytes_relayed"] == 0


def test_unknown_session_is_refused() -> None:
    relay = Relay()
    node = relay.registered(relay.node())
    [(refused, _)] = decoded(relay.data(424242, b"x", node.address))
    assert (refused.code, refused.session) == ("no-session", 424242)


def test_data_before_accept_is_not_forwarded() -> None:
    relay = Relay()
    server = relay.registered(relay.node())
    requester = relay.registered(relay.node(), serving=False)
    incoming = only(
        relay.say(Connect(request=1, peer=server.key, candidates=[]), requester.address)
    )
    assert relay.data(incoming.session, b"early", server.address) == []


def test_the_byte_cap_closes_both_ends_and_the_crossing_packet_stays() -> None:
    relay = Relay(session_bytes=100)
    server = relay.registered(relay.node())
    requester = relay.registered(relay.node(), serving=False)
    session, _ = relay.open_session(requester, server)
    assert len(relay.data(session, bytes(60), requester.address)) == 1
    assert len(relay.data(session, bytes(40), server.address)) == 1  # exactly at the cap
    out = decoded(relay.data(session, bytes(1), requester.address))
    assert sorted(to for _, to in out) == sorted([requester.address, server.address])
    for close, _ in out:
        assert isinstance(close, Close)
        assert (close.session, close.code) == (session, "byte-cap")
    assert relay.core.session_count == 0
    assert relay.core.stats(relay.now)["bytes_relayed"] == 100
    assert only(decoded(relay.data(session, b"x", server.address))).code == "no-session"


def test_time_cap_and_idle_close_sessions() -> None:
    relay = Relay(session_seconds=100.0, session_idle=30.0, registration_timeout=1000.0)
    server = relay.registered(relay.node())
    requester = relay.registered(relay.node(), serving=False)
    capped, _ = relay.open_session(requester, server, 1)
    idle, _ = relay.open_session(requester, server, 2)
    for _ in range(4):
        relay.now += 20
        relay.data(capped, b"x", requester.address)
        out = relay.tick(0)
        if out:
            break
    assert {(m.session, m.code) for m, _ in out} == {(idle, "idle")}
    assert len(out) == 2
    for _ in range(2):  # 60 s, 80 s: busy and young enough
        relay.now += 20
        assert len(relay.data(capped, b"x", requester.address)) == 1
        assert relay.tick(0) == []
    relay.now += 20  # 100 s: the lifetime cap, whatever the traffic
    out = relay.tick(0)
    assert {(m.session, m.code) for m, _ in out} == {(capped, "time-cap")}
    assert relay.core.stats(relay.now)["closes"] == {"idle": 1, "time-cap": 1}


def test_rate_limit_drops_the_excess() -> None:
    relay = Relay(session_rate=30_000)  # burst = max(rate, 16 packets) = 30 kB
    server = relay.registered(relay.node())
    requester = relay.registered(relay.node(), serving=False)
    session, _ = relay.open_session(requester, server)
    sent = sum(len(relay.data(session, bytes(1000), requester.address)) for _ in range(50))
    assert sent == 30
    relay.now += 0.5  # 15 kB of new tokens
    sent = sum(len(relay.data(session, bytes(1000), requester.address)) for _ in range(50))
    assert sent == 15
    assert relay.core.session_count == 1  # dropping is silent; the session lives


def test_close_from_one_end_reaches_the_other() -> None:
    relay = Relay()
    server = relay.registered(relay.node())
    requester = relay.registered(relay.node(), serving=False)
    session, _ = relay.open_session(requester, server)
    [(close, to)] = relay.say(Close(session=session, code="closed", message="bye"), server.address)
    assert (close.session, close.code, close.message, to) == (
        session,
        "closed",
        "bye",
        requester.address,
    )
    assert relay.core.session_count == 0
    # A third party cannot close someone else's session.
    session, _ = relay.open_session(requester, server, 2)
    intruder = relay.registered(relay.node())
    assert relay.say(Close(session=session, code="closed", message=""), intruder.address) == []
    assert relay.core.session_count == 1


def test_an_expired_registration_closes_its_sessions_at_the_other_end() -> None:
    relay = Relay(registration_timeout=45.0, session_idle=0.0)
    server = relay.registered(relay.node())
    requester = relay.registered(relay.node(), serving=False)
    session, _ = relay.open_session(requester, server)
    for _ in range(3):
        relay.now += 20
        relay.say(KeepAlive(seq=1), server.address)
    out = relay.tick(0)
    assert [(m.session, m.code, to) for m, to in out] == [(session, "idle", server.address)]
    assert relay.core.session_count == 0


def test_a_new_key_at_a_known_address_ends_the_old_nodes_sessions() -> None:
    relay = Relay()
    server = relay.registered(relay.node())
    requester = relay.registered(relay.node(), serving=False)
    relay.open_session(requester, server)
    replacement = Node(Identity.generate(), requester.address)
    out = relay.register(replacement, serving=False)
    assert [(type(m), to) for m, to in out] == [
        (Close, server.address),
        (Registered, requester.address),
    ]
    assert relay.core.session_count == 0 and relay.core.registration_count == 2


def test_shutdown_closes_every_session_at_both_ends() -> None:
    relay = Relay()
    server = relay.registered(relay.node())
    requester = relay.registered(relay.node(), serving=False)
    session, _ = relay.open_session(requester, server)
    pending = only(
        relay.say(Connect(request=99, peer=server.key, candidates=[]), requester.address)
    )
    out = decoded(relay.core.shutdown(relay.now))
    closes = {(m.session, to) for m, to in out if isinstance(m, Close)}
    assert closes == {
        (session, server.address),
        (session, requester.address),
        (pending.session, server.address),
    }
    [refused] = [m for m, _ in out if isinstance(m, Refused)]
    assert (refused.code, refused.session) == ("shutting-down", 99)
    assert all(m.code == "shutting-down" for m, _ in out)


# --- no amplification -------------------------------------------------------------------------


def _every_kind_of_packet(session: int, pending: int, key: bytes) -> list[bytes]:
    """Each packet kind at its smallest and at the sizes nodes send, and garbage."""
    far = [f"[2001:db8::{n}]:65535" for n in range(8)]
    secret, mac = bytes(16), bytes(16)
    messages: list[RelayMessage] = [
        Hello(),
        Hello(padding=bytes(256)),
        Challenge(nonce=bytes(32), observed=""),
        Registered(observed="", keepalive=0, session_bytes=0, session_seconds=0),
        Refused(code="", message=""),
        Incoming(session=0, peer=key, observed="", candidates=[], secret=secret),
        Connected(request=0, session=0, observed="", candidates=[], secret=secret),
        KeepAliveAck(seq=0, registered=False, observed=""),
        wire.Probe(session=session, tx=0, reply=False, mac=mac),
        ReachProbe(seq=0),
        Connect(request=0, peer=key, candidates=[]),
        Connect(request=2**32 - 1, peer=key, candidates=far),
        Connect(request=0, peer=bytes(32), candidates=[]),  # nobody's key
        Accept(session=0, candidates=[]),
        Accept(session=session, candidates=[]),
        Accept(session=pending, candidates=far),
        Decline(session=0),
        Decline(session=pending),
        Close(session=session, code="", message=""),
        Close(session=pending, code="closed", message="x" * 256),
        KeepAlive(seq=0),
        KeepAlive(seq=2**32 - 1),
        ReachTest(seq=0),
        ReachTest(seq=2**32 - 1),
    ]
    packets = [encode_packet(message) for message in messages]
    packets += [hello_packet(), keepalive_packet(0), keepalive_packet(2**32 - 1)]
    for target in (0, session, pending, 2**63 - 1):
        for size in (0, 1, 16, 17, 40, 1200):
            packets.append(encode_data(target, bytes(size)))
    for kind in range(0x40):
        for tail in (b"", b"\x90", b"\x91\x00", b"\x92\x00\xc4\x00", bytes(40)):
            packets.append(bytes((kind,)) + b"GM\x01" + tail)
    noise = random.Random(7)
    packets += [b"", b"\x00", b"GM", b"\x0dGM"] + [noise.randbytes(n) for n in (1, 13, 99, 1500)]
    return packets


def test_no_answer_to_an_unregistered_address_is_larger_than_its_packet() -> None:
    """Every kind of packet from an address that has not registered, each from a
    fresh one (no throttle hides an answer): what comes back is never larger."""
    relay = Relay()
    server = relay.registered(relay.node())
    requester = relay.registered(relay.node(), serving=False)
    session, _ = relay.open_session(requester, server)
    pending = only(relay.say(Connect(request=2, peer=server.key, candidates=[]), requester.address))
    ports = itertools.count(1)

    def answers(packet: bytes, core: RelayCore | None = None) -> list[Send]:
        source = ("203.0.113.9", next(ports))
        out = (core or relay.core).handle(packet, source, relay.now)
        for reply, to in out:
            assert to == source
            assert len(reply) <= len(packet), (packet[:8], reply[:8])
        return out

    relay.core.probe_port = 2**16 - 1
    for packet in _every_kind_of_packet(session, pending.session, server.key):
        answers(packet)
        source = ("203.0.113.9", next(ports))
        for reply, to in relay.core.handle_probe_port(packet, source, relay.now):
            assert to == source and len(reply) <= len(packet), (packet[:8], reply[:8])
    # Registrations, good and bad, on an open and a private relay.
    private = Relay(open=False, tokens=("t",))
    for core in (relay.core, private.core):
        for signer in (Identity.generate(), None):
            node = relay.node("203.0.113.9", next(ports))
            for nonce in (relay.challenge(node.address), bytes(32)):
                message = registration(node, nonce)
                if signer is not None:
                    message = Register(
                        public_key=node.key,
                        nonce=nonce,
                        signature=signer.sign(register_payload(nonce, node.key, True)),
                        token_proof=b"",
                        serving=True,
                    )
                source = node.address
                out = core.handle(encode_packet(message), source, relay.now)
                assert len(out) == 1 and len(out[0][0]) <= len(encode_packet(message))
    # What real nodes send is still answered, within its size.
    assert isinstance(only(decoded(answers(hello_packet()))), Challenge)
    for size in (len(hello_packet()), 1200, wire.MAX_PACKET):  # path MTU probes too
        hello = encode_packet(Hello(padding=bytes(size - len(encode_packet(Hello())) - 1)))
        assert isinstance(only(decoded(answers(hello))), Challenge)
        source = ("203.0.113.9", next(ports))
        assert len(relay.core.handle_probe_port(hello, source, relay.now)) == 1
    # The longest address a relay reports, with the highest second port, still fits
    # in the smallest Hello it answers.
    longest = Challenge(
        nonce=bytes(32),
        observed="[ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:65535",
        probe_port=65535,
    )
    assert len(encode_packet(longest)) <= HELLO_MIN_SIZE
    ack = only(decoded(answers(keepalive_packet(3))))
    assert (ack.seq, ack.registered) == (3, False)
    connect = encode_packet(Connect(request=4, peer=server.key, candidates=[]))
    refused = only(decoded(answers(connect)))
    assert (refused.code, refused.message, refused.session) == ("not-registered", "", 4)
    refused = only(decoded(answers(encode_data(session, b"\x40" + bytes(40)))))
    assert (refused.code, refused.session) == ("not-registered", session)
    assert only(decoded(answers(encode_packet(ReachTest(seq=5))))) == ReachProbe(seq=5)
    node = relay.node()
    out = relay.say(registration(node, relay.challenge(node.address)), node.address)
    assert isinstance(only(out), Registered)
    # Nothing reached the two ends of the session.
    assert relay.core.stats(relay.now)["bytes_relayed"] == 0


def test_a_registered_node_is_answered_even_unpadded() -> None:
    """Older nodes send bare KeepAlives: a registered address proved it is real."""
    relay = Relay()
    node = relay.registered(relay.node())
    ack = only(relay.say(KeepAlive(seq=1), node.address))
    assert len(encode_packet(ack)) > len(encode_packet(KeepAlive(seq=1)))
    assert len(keepalive_packet(1)) == wire.KEEPALIVE_MIN_SIZE
    longest = KeepAliveAck(seq=2**32 - 1, registered=True, observed="x" * 64)
    assert len(encode_packet(longest)) <= wire.KEEPALIVE_MIN_SIZE


# --- hostile input ----------------------------------------------------------------------------


def test_malformed_packets_are_dropped() -> None:
    relay = Relay()
    node = relay.registered(relay.node())
    bad = [
        b"",
        b"\x01",
        b"\x01GM",
        b"\x01GM\x02" + bytes(200),  # another wire version
        b"\x3fGM\x01",  # unknown type
        encode_packet(Hello(padding=bytes(200)))[:-5],  # truncated
        b"\x0bGM\x01\x00",  # a data header cut short
        b"\x0bGM\x09" + bytes(20),  # data of another version
        encode_data(1, bytes(wire.MAX_PACKET)),  # oversized
        b"\xc3" + bytes(1200),  # a QUIC long header: not ours
    ]
    for packet in bad:
        assert relay.send(packet, node.address) == [], packet[:8]
    assert relay.core.registration_count == 1


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=1600), st.integers(min_value=0, max_value=0x11))
def test_random_packets_never_crash(payload: bytes, kind: int) -> None:
    relay = Relay()
    node = relay.node()  # not registered: no answer may be larger than the packet
    packet = bytes((kind,)) + b"GM\x01" + payload if payload[:1] != b"!" else payload
    out = relay.send(packet, node.address)
    for reply, to in out:
        assert to == node.address and len(reply) <= min(len(packet), wire.MAX_PACKET)


def test_session_ids_are_random_sized_and_unique() -> None:
    relay = Relay(max_sessions_per_pair=20)
    relay.core = RelayCore(relay.config, secret=SECRET, random_bytes=random.randbytes)
    server = relay.registered(relay.node())
    requester = relay.registered(relay.node(), serving=False)
    ids = {relay.open_session(requester, server, request)[0] for request in range(20)}
    assert len(ids) == 20 and all(0 < i < 2**63 for i in ids)


# --- settings ---------------------------------------------------------------------------------


def test_private_by_default() -> None:
    with pytest.raises(ConfigError, match="private by default"):
        RelayConfig().check()
    assert RelayConfig(open=True).check().access_summary() == "open: any node may register"
    two = RelayConfig(allow=frozenset({"a", "b"}), tokens=("t",))
    assert two.access_summary() == "private: 2 allowed nodes, token"


def test_defaults_match_the_wire_contract() -> None:
    assert relay_config.DEFAULT_RELAY_PORT == wire.DEFAULT_RELAY_PORT
    config = RelayConfig()
    assert (config.keepalive, config.registration_timeout, config.session_idle) == (10, 45, 120)
    assert config.session_bytes == 10 * 1000**3 and config.session_seconds == 86400


def test_allow_file_names_the_bad_line(tmp_path: Path) -> None:
    good = node_id_for(Identity.generate().public_key)
    path = tmp_path / "nodes.txt"
    # Another last character breaks the check characters (the same one would not:
    # an id ending in "x" already, one time in 32, stayed valid and the test failed).
    bad = good[:-1] + ("y" if good.endswith("x") else "x")
    path.write_text(f"# friends\n{good}  # alice\n\n{bad}\n")
    with pytest.raises(ConfigError, match=r"nodes\.txt:4: .* is not a node id"):
        read_allow_file(path)
    path.write_text(f"# friends\n{good}  # alice\n")
    assert read_allow_file(path) == {good}


def test_config_file_keys_units_and_typos(tmp_path: Path) -> None:
    path = tmp_path / "relay.toml"
    path.write_text(
        'listen = "127.0.0.1:5000"\nsession_bytes = "2GB"\nsession_idle = "2m"\n'
        'max_per_ip = 4\ntoken_file = "token.txt"\nopen = false\n'
    )
    loaded = load_config_file(path)
    assert loaded["host"] == "127.0.0.1" and loaded["port"] == 5000
    assert loaded["session_bytes"] == 2 * 1000**3 and loaded["session_idle"] == 120.0
    assert loaded["token_file"] == tmp_path / "token.txt"
    path.write_text("max_per_ipp = 4\n")
    with pytest.raises(ConfigError, match="unknown setting 'max_per_ipp'"):
        load_config_file(path)
    path.write_text("max_per_ip = '4'\n")
    with pytest.raises(ConfigError, match="whole number"):
        load_config_file(path)


def test_session_quotas_are_settings(tmp_path: Path) -> None:
    from gpumesh.relay.main import build_config

    config = RelayConfig(open=True).check()
    assert (config.max_sessions, config.max_sessions_initiated, config.max_sessions_per_pair) == (
        64,
        32,
        8,
    )
    with pytest.raises(ConfigError, match=r"max_sessions_per_pair \(8\) must be below"):
        RelayConfig(open=True, max_sessions=8).check()
    with pytest.raises(ConfigError, match="max_sessions_initiated must be at least 1"):
        RelayConfig(open=True, max_sessions_initiated=0).check()
    path = tmp_path / "relay.toml"
    path.write_text("open = true\nmax_sessions_initiated = 5\nmax_sessions_per_pair = 3\n")
    assert load_config_file(path) == {
        "open": True,
        "max_sessions_initiated": 5,
        "max_sessions_per_pair": 3,
    }
    built = build_config({"config_file": path, "max_sessions_per_pair": 2})
    assert (built.max_sessions_initiated, built.max_sessions_per_pair) == (5, 2)


def test_listen_and_duration_parsing() -> None:
    assert parse_listen("0.0.0.0:4799") == ("0.0.0.0", 4799)
    assert parse_listen(":5000") == ("0.0.0.0", 5000)
    assert parse_listen("[::]:6000") == ("::", 6000)
    assert parse_listen("127.0.0.1") == ("127.0.0.1", 4799)
    with pytest.raises(ConfigError):
        parse_listen("host:99999")
    assert parse_duration("45") == 45.0 and parse_duration("2m") == 120.0
    assert parse_duration("24h") == 86400.0
    with pytest.raises(ConfigError):
        parse_duration("soon")


def test_address_text() -> None:
    assert address_text(("192.0.2.1", 5)) == "192.0.2.1:5"
    assert address_text(("::ffff:192.0.2.1", 5)) == "192.0.2.1:5"
    assert address_text(("2001:db8::1", 5)) == "[2001:db8::1]:5"


# --- the server's output queues (a fake socket: the policy, not the kernel) ---------------------


class _BlockingSocket:
    def __init__(self) -> None:
        self.blocked = True
        self.sent: list[tuple[bytes, Address]] = []

    def fileno(self) -> int:
        return 99

    def sendto(self, data: bytes, address: Address) -> int:
        if self.blocked:
            raise BlockingIOError
        self.sent.append((data, address))
        return len(data)


class _Loop:
    def __init__(self) -> None:
        self.writers: dict[int, Any] = {}

    def add_writer(self, fd: int, callback: Any) -> None:
        self.writers[fd] = callback

    def remove_writer(self, fd: int) -> None:
        del self.writers[fd]


def test_queues_are_bounded_per_destination_and_drain_round_robin() -> None:
    from gpumesh.relay.server import RelayServer

    server = RelayServer(RelayConfig(open=True, queue=3))
    sock, loop = _BlockingSocket(), _Loop()
    server._sock, server._loop = sock, loop  # type: ignore[assignment]
    slow, other = ("192.0.2.1", 1), ("192.0.2.2", 2)
    for n in range(10):
        server._send(b"slow%d" % n, slow)
    server._send(b"other0", other)
    server._send(b"other1", other)
    assert server.dropped == 7  # only the slow destination lost packets
    assert list(loop.writers) == [99]
    sock.blocked = False
    loop.writers[99]()
    assert [data for data, _ in sock.sent] == [
        b"slow0",
        b"other0",
        b"slow1",
        b"other1",
        b"slow2",
    ]
    assert loop.writers == {}  # nothing left: stop watching for writability
    server._send(b"now", other)
    assert sock.sent[-1] == (b"now", other)


def test_a_run_of_one_sessions_packets_is_forwarded_whole_and_counted() -> None:
    relay = Relay(session_bytes=10_000)
    server = relay.registered(relay.node())
    requester = relay.registered(relay.node(), serving=False)
    session, _ = relay.open_session(requester, server)
    packet = encode_data(session, bytes(100))
    run = packet * 3
    core = relay.core
    assert core.forward_run(run, len(packet), requester.address, relay.now) == server.address
    assert core.bytes_relayed == 300
    # not from an end of the session, mixed sessions, or over the cap: one by one instead
    stranger = relay.registered(relay.node())
    assert core.forward_run(run, len(packet), stranger.address, relay.now) is None
    mixed = packet * 2 + encode_data(session + 1, bytes(100))
    assert core.forward_run(mixed, len(packet), requester.address, relay.now) is None
    big = encode_data(session, bytes(1400))
    assert core.forward_run(big * 8, len(big), requester.address, relay.now) is None
    assert core.bytes_relayed == 300
