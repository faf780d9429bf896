"""The relay over TCP, without sockets: a connection's address to the core, what the
core does when a connection closes, and the settings and certificates of the TCP
listener. (Over real connections: tests/integration/test_relay_tcp.py.)"""

from __future__ import annotations

import datetime
import itertools
import ssl
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from gpumesh.errors import ConfigError
from gpumesh.identity.keys import Identity
from gpumesh.protocol.addresses import Address
from gpumesh.protocol.relay import (
    Accept,
    Challenge,
    Close,
    Connect,
    Connected,
    Incoming,
    Refused,
    Register,
    Registered,
    RelayMessage,
    decode_data,
    decode_packet,
    encode_data,
    encode_packet,
    hello_packet,
    is_data,
    register_payload,
    token_proof,
)
from gpumesh.protocol.relaycore import (
    TCP_PORT_BASE,
    RelayCore,
    Send,
    address_text,
    is_tcp_address,
    tcp_address,
)
from gpumesh.relay.config import RelayConfig, load_config_file, parse_tcp
from gpumesh.relay.main import build_config
from gpumesh.relay.tcp import self_signed_certificate, tls_context

START = 1_000_000.0
UDP = ("198.51.100.7", 47000)
TCP = tcp_address("198.51.100.7", 47000)  # the same host and port number, over TCP


class Relay:
    """A core with a fake clock; nodes speak for themselves through :meth:`say`."""

    def __init__(self, **settings: Any) -> None:
        settings.setdefault("open", True)
        counter = itertools.count(1)
        self.core = RelayCore(
            RelayConfig(**settings),
            secret=b"s" * 32,
            random_bytes=lambda n: next(counter).to_bytes(n, "big"),
        )
        self.now = START

    def say(self, message: RelayMessage | bytes, source: Address) -> list[tuple[Any, Address]]:
        packet = message if isinstance(message, bytes) else encode_packet(message)
        return decoded(self.core.handle(packet, source, self.now))

    def challenge(self, source: Address) -> Challenge:
        [(challenge, to)] = self.say(hello_packet(), source)
        assert isinstance(challenge, Challenge) and to == source
        return challenge

    def register(
        self, identity: Identity, source: Address, *, serving: bool = True, nonce: bytes = b""
    ) -> Any:
        nonce = nonce or self.challenge(source).nonce
        signature = identity.sign(register_payload(nonce, identity.public_key, serving))
        register = Register(
            public_key=identity.public_key,
            nonce=nonce,
            signature=signature,
            token_proof=token_proof("", nonce),
            serving=serving,
        )
        [(reply, to)] = self.say(register, source)
        assert to == source
        return reply


def decoded(out: list[Send]) -> list[tuple[Any, Address]]:
    return [
        (decode_data(packet) if is_data(packet) else decode_packet(packet), address)
        for packet, address in out
    ]


# --- a connection's address -------------------------------------------------------------------


def test_a_tcp_address_keeps_the_host_and_shows_the_real_port() -> None:
    assert TCP == ("198.51.100.7", TCP_PORT_BASE + 47000)
    assert is_tcp_address(TCP) and not is_tcp_address(UDP)
    assert not is_tcp_address(("198.51.100.7", 65535))  # the highest UDP port
    assert address_text(TCP) == address_text(UDP) == "198.51.100.7:47000"
    assert address_text(tcp_address("::ffff:192.0.2.1", 443)) == "192.0.2.1:443"
    assert address_text(tcp_address("2001:db8::1", 443)) == "[2001:db8::1]:443"


def test_a_node_registers_over_tcp_and_is_told_its_tcp_address() -> None:
    relay = Relay()
    challenge = relay.challenge(TCP)
    assert challenge.observed == "198.51.100.7:47000"
    registered = relay.register(Identity.generate(), TCP, nonce=challenge.nonce)
    assert isinstance(registered, Registered)
    assert registered.observed == "198.51.100.7:47000"
    assert relay.core.is_registered(TCP) and not relay.core.is_registered(UDP)


def test_a_challenge_fetched_over_one_transport_cannot_register_the_other() -> None:
    relay = Relay()
    node = Identity.generate()
    over_tcp, over_udp = relay.challenge(TCP).nonce, relay.challenge(UDP).nonce
    assert over_tcp != over_udp
    assert relay.register(node, UDP, nonce=over_tcp).code == "bad-nonce"
    assert relay.register(node, TCP, nonce=over_udp).code == "bad-nonce"
    assert relay.core.registration_count == 0


def test_the_per_ip_limit_counts_udp_and_tcp_of_one_host_together() -> None:
    relay = Relay(max_per_ip=2)
    assert isinstance(relay.register(Identity.generate(), UDP), Registered)
    assert isinstance(relay.register(Identity.generate(), TCP), Registered)
    third = relay.register(Identity.generate(), tcp_address(UDP[0], 47001))
    assert third.code == "too-many-per-ip"


def _session(relay: Relay, requester: Address, server: Address) -> int:
    serving, dialing = Identity.generate(), Identity.generate()
    assert isinstance(relay.register(serving, server), Registered)
    assert isinstance(relay.register(dialing, requester, serving=False), Registered)
    connect = Connect(request=3, peer=serving.public_key, candidates=[])
    [(incoming, to)] = relay.say(connect, requester)
    assert isinstance(incoming, Incoming) and to == server
    assert incoming.observed == address_text(requester)
    [(connected, to)] = relay.say(Accept(session=incoming.session, candidates=[]), server)
    assert isinstance(connected, Connected) and to == requester
    session: int = incoming.session
    return session


def test_data_crosses_between_a_tcp_and_a_udp_node_byte_for_byte() -> None:
    relay = Relay()
    session = _session(relay, TCP, ("203.0.113.9", 5000))
    packet = encode_data(session, b"\xc0" + bytes(range(256)) * 4)
    assert relay.core.handle(packet, TCP, relay.now) == [(packet, ("203.0.113.9", 5000))]
    back = encode_data(session, b"\x40back")
    assert relay.core.handle(back, ("203.0.113.9", 5000), relay.now) == [(back, TCP)]


# --- a connection that closes -----------------------------------------------------------------


def test_a_closed_connection_ends_its_sessions_at_the_other_end_at_once() -> None:
    relay = Relay(max_per_ip=1)
    other = ("203.0.113.9", 5000)
    session = _session(relay, TCP, other)
    relay.now += 1.0
    [(close, to)] = decoded(relay.core.disconnect(TCP, relay.now))
    assert to == other
    assert (close.session, close.code) == (session, "closed")
    assert not relay.core.is_registered(TCP) and relay.core.is_registered(other)
    assert relay.core.session_count == 0
    assert relay.core.stats(relay.now)["closes"] == {"closed": 1}
    # Its slot on the host is free again, and nothing is left to tell.
    assert isinstance(relay.register(Identity.generate(), TCP), Registered)
    assert relay.core.disconnect(tcp_address("192.0.2.1", 1), relay.now) == []


def test_a_closed_connection_ends_sessions_not_yet_accepted() -> None:
    relay = Relay()
    serving, dialing = Identity.generate(), Identity.generate()
    dialer = ("203.0.113.9", 5000)
    assert isinstance(relay.register(serving, TCP), Registered)
    assert isinstance(relay.register(dialing, dialer, serving=False), Registered)
    [(incoming, _)] = relay.say(Connect(request=4, peer=serving.public_key, candidates=[]), dialer)
    # The serving end went away before it answered: the requester is refused.
    [(refused, to)] = decoded(relay.core.disconnect(TCP, relay.now))
    assert isinstance(refused, Refused) and to == dialer
    assert (refused.code, refused.session) == ("unknown-peer", 4)
    assert "went away" in refused.message
    # The requesting end went away: the serving end is told, with the session's id.
    server = ("203.0.113.10", 6000)
    assert isinstance(relay.register(serving, server), Registered)
    assert isinstance(relay.register(dialing, TCP, serving=False), Registered)
    [(incoming, _)] = relay.say(Connect(request=5, peer=serving.public_key, candidates=[]), TCP)
    [(close, to)] = decoded(relay.core.disconnect(TCP, relay.now))
    assert isinstance(close, Close) and to == server
    assert (close.session, close.code) == (incoming.session, "closed")
    assert relay.core.session_count == 0


# --- settings ---------------------------------------------------------------------------------


def test_the_tcp_address_defaults_to_port_443_and_a_bad_one_names_the_flag() -> None:
    assert parse_tcp("0.0.0.0") == ("0.0.0.0", 443)
    assert parse_tcp("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_tcp("[::]:8443") == ("::", 8443)
    for bad in ("127.0.0.1:https", "[::1", "1.2.3.4:70000"):
        with pytest.raises(ConfigError, match=r"^--tcp: invalid listen address"):
            parse_tcp(bad)


def test_flags_set_the_tcp_listener_and_its_certificate(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    config = build_config(
        {"open_": True, "tcp": "127.0.0.1:8443", "tls_cert": cert, "tls_key": key}
    )
    assert (config.tcp_host, config.tcp_port) == ("127.0.0.1", 8443)
    assert (config.tls_cert, config.tls_key) == (cert, key)
    assert build_config({"open_": True}).tcp_port is None


def test_a_certificate_needs_its_key_and_the_tcp_listener() -> None:
    with pytest.raises(ConfigError, match="both the TLS certificate and its key"):
        RelayConfig(open=True, tcp_port=443, tls_cert=Path("cert.pem")).check()
    with pytest.raises(ConfigError, match="both the TLS certificate and its key"):
        RelayConfig(open=True, tcp_port=443, tls_key=Path("key.pem")).check()
    with pytest.raises(ConfigError, match="give --tcp too"):
        RelayConfig(open=True, tls_cert=Path("c"), tls_key=Path("k")).check()
    with pytest.raises(ConfigError, match="invalid tcp port"):
        RelayConfig(open=True, tcp_port=65536).check()


def test_the_config_file_takes_tcp_and_certificate_paths_relative_to_it(
    tmp_path: Path,
) -> None:
    (tmp_path / "etc").mkdir()
    file = tmp_path / "etc" / "relay.toml"
    file.write_text('tcp = "[::]:443"\ntls_cert = "cert.pem"\ntls_key = "/keys/key.pem"\n')
    settings = load_config_file(file)
    assert (settings["tcp_host"], settings["tcp_port"]) == ("::", 443)
    assert settings["tls_cert"] == tmp_path / "etc" / "cert.pem"
    assert settings["tls_key"] == Path("/keys/key.pem")
    file.write_text('tcp = "host:port"\n')
    with pytest.raises(ConfigError, match=r"relay.toml: tcp: invalid listen address"):
        load_config_file(file)


# --- certificates -----------------------------------------------------------------------------


def _pair(folder: Path, name: str) -> tuple[Path, Path]:
    cert_pem, key_pem = self_signed_certificate()
    cert, key = folder / f"{name}.crt", folder / f"{name}.key"
    cert.write_bytes(cert_pem)
    key.write_bytes(key_pem)
    return cert, key


def test_the_made_certificate_is_fresh_and_self_signed() -> None:
    now = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)
    first, key_pem = self_signed_certificate(now)
    cert = x509.load_pem_x509_certificate(first)
    assert cert.issuer == cert.subject
    assert cert.not_valid_before_utc < now < cert.not_valid_after_utc
    key = serialization.load_pem_private_key(key_pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert self_signed_certificate(now)[0] != first  # a new key each start
    context, presented = tls_context(RelayConfig(open=True, tcp_port=0))
    assert isinstance(context, ssl.SSLContext) and "self-signed" in presented


def test_a_given_certificate_is_loaded_and_a_bad_one_is_one_clear_error(tmp_path: Path) -> None:
    cert, key = _pair(tmp_path, "good")
    _, other_key = _pair(tmp_path, "other")
    config = RelayConfig(open=True, tcp_port=0, tls_cert=cert, tls_key=key)
    assert str(cert) in tls_context(config)[1]
    encrypted = tmp_path / "encrypted.key"
    loaded = serialization.load_pem_private_key(key.read_bytes(), password=None)
    encrypted.write_bytes(
        loaded.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    cases = [
        (tmp_path / "missing.crt", key, "cannot read the TLS certificate"),
        (cert, tmp_path / "missing.key", "cannot read the TLS key"),
        (junk, key, "holds no PEM certificate"),
        (key, key, "holds no PEM certificate"),
        (cert, junk, "holds no PEM private key"),
        (cert, other_key, "is not the key of the certificate"),
        (cert, encrypted, "is encrypted"),
    ]
    for cert_path, key_path, needle in cases:
        bad = RelayConfig(open=True, tcp_port=0, tls_cert=cert_path, tls_key=key_path)
        with pytest.raises(ConfigError, match=needle):
            tls_context(bad)
