"""LAN discovery without sockets: the pair's secret, the announcements, matching,
replays, rate limits and bounds (protocol/lan.py); its settings; the pool's
preference for a session on the LAN."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from gpumesh.client.pool import LAN_KEEP, SessionPool
from gpumesh.errors import ConfigError, IdentityError, ProtocolError
from gpumesh.identity.keys import Identity, NodeId, x25519_public_of
from gpumesh.protocol import lan
from gpumesh.store.config import DEFAULT_LAN_PORT, Config
from gpumesh.store.peers import Peer

NOW = 1_700_000_000.0


def _pair() -> tuple[Identity, Identity, bytes, bytes]:
    """alice, bob, and the keys of alice's tags for bob and of bob's for alice."""
    alice, bob = Identity.generate(), Identity.generate()
    secret = alice.shared_secret(bob.public_key)
    return (
        alice,
        bob,
        lan.lan_key(secret, alice.public_key, bob.public_key),
        lan.lan_key(secret, bob.public_key, alice.public_key),
    )


def _announce(keys: list[bytes], *, port: int = 47000, now: float = NOW) -> list[bytes]:
    return lan.announcements(keys, port=port, answer=False, now=now, random=os.urandom)


def _listener(**keys: bytes) -> lan.Listener:
    listener = lan.Listener()
    listener.set_peers(keys)
    return listener


# --- the pair's secret -----------------------------------------------------------------------


def test_both_ends_of_a_pair_compute_the_same_secret_and_nobody_else_does() -> None:
    alice, bob = Identity.generate(), Identity.generate()
    carol = Identity.generate()
    secret = alice.shared_secret(bob.public_key)
    assert secret == bob.shared_secret(alice.public_key)
    assert len(secret) == 32
    assert carol.shared_secret(bob.public_key) != secret
    assert carol.shared_secret(alice.public_key) != secret


def test_the_converted_public_key_is_the_x25519_key_of_the_ed25519_scalar() -> None:
    identity = Identity.generate()
    seed = identity.private_key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    private = X25519PrivateKey.from_private_bytes(hashlib.sha512(seed).digest()[:32])
    raw = private.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    assert x25519_public_of(identity.public_key) == raw


@pytest.mark.parametrize(
    "key",
    [b"\x01" + bytes(31), bytes(31), (2**255 - 19).to_bytes(32, "little"), bytes(32)],
    ids=["identity-point", "short", "not-in-the-field", "small-order"],
)
def test_a_key_with_no_usable_secret_is_an_identity_error(key: bytes) -> None:
    with pytest.raises(IdentityError):
        Identity.generate().shared_secret(key)


def test_the_keys_are_directional() -> None:
    _alice, _bob, a_to_b, b_to_a = _pair()
    assert a_to_b != b_to_a
    # bob recognises alice's announcement; alice does not take it for bob's.
    packet = _announce([a_to_b])[0]
    assert _listener(alice=a_to_b).receive(packet, "10.0.0.1", NOW).peers == ("alice",)
    assert _listener(bob=b_to_a).receive(packet, "10.0.0.1", NOW).dropped == "no paired peer's tag"


# --- the datagram ----------------------------------------------------------------------------


def test_an_announcement_decodes_to_what_was_encoded() -> None:
    announcement = lan.Announcement(47000, lan.FLAG_ANSWER, b"n" * 8, (b"t" * 10,) * 8)
    data = lan.encode(announcement)
    assert data.startswith(lan.MAGIC)
    assert len(data) == lan.HEADER_SIZE + 80
    assert lan.decode(data) == announcement
    assert lan.decode(data).answer


def test_tags_are_padded_and_split_and_every_peer_is_in_one_datagram() -> None:
    keys = [bytes([i]) * 32 for i in range(lan.MAX_TAGS + 3)]
    packets = _announce(keys)
    assert len(packets) == 2
    assert {len(lan.decode(p).tags) for p in packets} == {lan.MAX_TAGS, lan.TAG_PAD}
    assert all(len(p) <= lan.MAX_SIZE for p in packets)
    listener = _listener(**{f"p{i}": key for i, key in enumerate(keys)})
    heard = [listener.receive(p, "10.0.0.1", NOW).peers for p in packets]
    assert sorted(itertools.chain(*heard)) == sorted(f"p{i}" for i in range(len(keys)))
    assert _announce([]) == []


def test_every_datagram_looks_new_even_from_the_same_node_in_the_same_window() -> None:
    _alice, _bob, a_to_b, _ = _pair()
    first, second = (lan.decode(_announce([a_to_b])[0]) for _ in range(2))
    assert first.nonce != second.nonce
    assert not set(first.tags) & set(second.tags)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "too short"),
        (lan.MAGIC + bytes(11 + 15), "not a whole number of tags"),
        (b"gmX\x01" + bytes(21), "not a GPUMesh announcement"),
        (b"gmL\x02" + bytes(21), "not a GPUMesh announcement"),
        (lan.MAGIC + bytes(lan.MAX_SIZE), "longer than"),
    ],
)
def test_a_malformed_datagram_is_a_protocol_error_and_a_drop(data: bytes, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        lan.decode(data)
    heard = lan.Listener().receive(data, "10.0.0.1", NOW)
    assert heard.dropped.startswith("malformed") and why in heard.dropped
    assert not heard.peers


# --- matching --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sent_ago", "matches"),
    [(0, True), (lan.WINDOW, True), (-lan.WINDOW, True), (2 * lan.WINDOW, False)],
)
def test_a_tag_matches_in_its_window_and_the_ones_either_side(
    sent_ago: float, matches: bool
) -> None:
    _alice, _bob, a_to_b, _ = _pair()
    packet = _announce([a_to_b], now=NOW - sent_ago)[0]
    heard = _listener(alice=a_to_b).receive(packet, "10.0.0.1", NOW)
    assert heard.peers == (("alice",) if matches else ())


def test_a_changed_port_or_flag_no_longer_matches() -> None:
    _alice, _bob, a_to_b, _ = _pair()
    packet = bytearray(_announce([a_to_b], port=47000)[0])
    packet[5:7] = (47001).to_bytes(2, "big")  # another port for the same tags
    assert _listener(alice=a_to_b).receive(bytes(packet), "10.0.0.9", NOW).peers == ()
    packet[5:7] = (47000).to_bytes(2, "big")
    packet[4] = lan.FLAG_ANSWER
    assert _listener(alice=a_to_b).receive(bytes(packet), "10.0.0.9", NOW).peers == ()


def test_a_match_says_the_port_and_whether_it_was_an_answer() -> None:
    _alice, _bob, a_to_b, _ = _pair()
    packet = lan.announcements([a_to_b], port=47123, answer=True, now=NOW, random=os.urandom)[0]
    heard = _listener(alice=a_to_b).receive(packet, "10.0.0.1", NOW)
    assert (heard.peers, heard.port, heard.answer) == (("alice",), 47123, True)


def test_a_replay_is_dropped_from_any_source() -> None:
    _alice, _bob, a_to_b, _ = _pair()
    listener = _listener(alice=a_to_b)
    packet = _announce([a_to_b])[0]
    assert listener.receive(packet, "10.0.0.1", NOW).peers == ("alice",)
    assert listener.receive(packet, "10.0.0.66", NOW + 1).dropped == "replayed"
    # Past the memory, the window has passed too: it no longer matches at all.
    late = listener.receive(packet, "10.0.0.66", NOW + lan.SEEN_KEEP + 1)
    assert late.dropped == "no paired peer's tag"


def test_the_replay_memory_is_bounded() -> None:
    _alice, _bob, a_to_b, _ = _pair()
    listener = _listener(alice=a_to_b, **{f"x{i}": bytes([i]) * 32 for i in range(3)})
    listener._total = lan.RateLimit(1e9, 1e9, keys=1)
    for n in range(lan.MAX_SEEN + 50):
        packet = _announce([a_to_b])[0]
        assert listener.receive(packet, f"10.{n // 65536}.{n // 256 % 256}.{n % 256}", NOW).peers
    assert listener.remembered == lan.MAX_SEEN
    assert listener.sources <= lan.MAX_SOURCES


# --- rate limits -----------------------------------------------------------------------------


def test_one_source_is_limited_and_said_once_until_it_slows_down() -> None:
    listener = lan.Listener(source_rate=1.0, source_burst=3.0)
    junk = b"junk"
    drops = [listener.receive(junk, "10.0.0.5", NOW) for _ in range(6)]
    assert [d.dropped.split(":")[0] for d in drops] == ["malformed"] * 3 + ["rate-limited"] * 3
    assert [d.quiet for d in drops[3:]] == [False, True, True]
    # Another source is not held back by it.
    assert listener.receive(junk, "10.0.0.6", NOW).dropped.startswith("malformed")
    # A second later one more gets through, and the next refusal is said again.
    assert listener.receive(junk, "10.0.0.5", NOW + 1).dropped.startswith("malformed")
    again = listener.receive(junk, "10.0.0.5", NOW + 1)
    assert (again.dropped, again.quiet) == ("rate-limited", False)


def test_all_sources_together_are_limited_before_any_hmac() -> None:
    _alice, _bob, a_to_b, _ = _pair()
    listener = lan.Listener(total_rate=1.0, total_burst=5.0)
    listener.set_peers({"alice": a_to_b})
    results = [listener.receive(b"x", f"10.0.1.{n}", NOW) for n in range(50)]
    assert sum(r.dropped.startswith("malformed") for r in results) == 5
    assert results[-1].dropped == "rate-limited (all sources)"
    assert listener.sources == 50


def test_rate_limits_forget_the_least_recent_sources_beyond_their_bound() -> None:
    limit = lan.RateLimit(1.0, 1.0, keys=4)
    for n in range(10):
        assert limit.allow(f"s{n}", NOW) == (True, False)
    assert len(limit) == 4


def test_a_gate_lets_each_key_through_once_per_gap() -> None:
    gate = lan.Gate(10.0, keys=2)
    assert gate.ready("alice", 100.0)
    assert not gate.ready("alice", 105.0)
    assert gate.ready("bob", 105.0)
    assert gate.ready("alice", 110.0)
    gate.ready("carol", 111.0)
    assert len(gate) == 2


# --- settings --------------------------------------------------------------------------------


def test_lan_settings_have_defaults_and_refuse_bad_values_in_one_line(tmp_path: Path) -> None:
    config = Config.load(tmp_path / "config.toml")
    assert config.lan_discovery is True
    assert (config.lan_port, config.lan_interval, config.lan_reprobe) == (DEFAULT_LAN_PORT, 30, 60)
    config.set("lan_discovery", "off")
    assert config.lan_discovery is False
    config.set("lan_interval", "1s")
    assert config.lan_interval == 1.0
    for key, value, said in [
        ("lan_discovery", "maybe", "invalid lan_discovery 'maybe': use on or off"),
        ("lan_port", "0", "invalid lan_port '0': use a UDP port from 1 to 65535"),
        ("lan_port", "http", "invalid lan_port 'http'"),
        ("lan_interval", "0.5s", "invalid lan_interval '0.5s': at least 1s"),
        ("lan_interval", "often", "invalid lan_interval 'often'"),
        ("lan_reprobe", "-5s", "invalid lan_reprobe '-5s'"),
    ]:
        with pytest.raises(ConfigError) as caught:
            config.set(key, value)
        assert said in caught.value.message
        assert "\n" not in caught.value.message


# --- the pool prefers the LAN ----------------------------------------------------------------


@dataclass
class _Link:
    is_closed: bool = False


class _Session:
    punched_address = None
    relayed = None

    def __init__(self) -> None:
        self.link = _Link()

    def close(self) -> None:
        self.link.is_closed = True


def _peer() -> Peer:
    return Peer(NodeId("alice-id"), "alice-pc", b"k", [], "", True, 0.0, None, "")


def test_a_lan_session_replaces_the_warm_one_which_closes_once_unused() -> None:
    clock = [100.0]
    pool = SessionPool(clock=lambda: clock[0])
    relayed, busy_lan, newest = _Session(), _Session(), _Session()
    peer = _peer()

    async def scenario() -> None:
        await pool.adopt(peer, relayed)  # type: ignore[arg-type]
        pool._warm["alice-id"].users = 1  # a request runs on it
        await pool.adopt(peer, busy_lan)  # type: ignore[arg-type]
        assert pool.current("alice-id").session is busy_lan  # type: ignore[union-attr]
        assert not relayed.link.is_closed  # its request goes on
        pool._retired[0].users = 0
        pool._close_retired()
        assert relayed.link.is_closed
        await pool.adopt(peer, newest)  # type: ignore[arg-type]
        assert busy_lan.link.is_closed  # unused: closed at once

    asyncio.run(scenario())


def test_a_lan_address_is_dialled_first_for_a_while() -> None:
    clock = [100.0]
    pool = SessionPool(clock=lambda: clock[0])
    pool.note_lan("alice-id", ("10.0.0.7", 47000))
    assert pool.lan_address("alice-id") == ("10.0.0.7", 47000)
    clock[0] += LAN_KEEP + 1
    assert pool.lan_address("alice-id") is None
    pool.note_lan("alice-id", ("10.0.0.7", 47000))
    pool.drop("alice-id", "unpaired", forget_path=True)
    assert pool.lan_address("alice-id") is None
