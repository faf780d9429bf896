"""protocol/admission: Initial headers, Retry packets and stateless tokens, without sockets."""

from __future__ import annotations

import os

from hypothesis import given
from hypothesis import strategies as st
from qh3 import QuicConnection
from qh3.quic import events as qe

from gpumesh.identity.keys import Identity
from gpumesh.protocol.admission import (
    TOKEN_LIFETIME,
    DropReason,
    RetryTokens,
    encode_retry,
    parse_initial,
)
from gpumesh.transport.quicsetup import client_configuration, server_configuration

CLIENT = ("198.51.100.7", 40000)
SERVER = ("203.0.113.1", 4242)


class FakeClock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


def _first_flight() -> tuple[QuicConnection, list[bytes]]:
    client = QuicConnection(configuration=client_configuration())
    client.connect(SERVER, now=0.0)
    return client, [data for data, _ in client.datagrams_to_send(now=0.0)]


def _initial(dcid: bytes, *, first: int = 0xC3, version: int = 1, token: bytes = b"") -> bytes:
    header = bytes([first]) + version.to_bytes(4, "big") + bytes([len(dcid)]) + dcid
    header += bytes([8]) + os.urandom(8) + bytes([len(token)]) + token
    return header + os.urandom(1200 - len(header))


# --- the Initial's header ---------------------------------------------------------------------


def test_a_real_client_initial_parses_with_its_ids() -> None:
    client, flight = _first_flight()
    header = parse_initial(flight[0])
    assert header is not None
    assert header.version == 1
    assert header.dcid == client.original_destination_connection_id
    assert header.scid == client.host_cid
    assert header.token == b""


def test_only_full_size_version_1_client_initials_parse() -> None:
    dcid = os.urandom(8)
    assert parse_initial(_initial(dcid)) is not None
    assert parse_initial(_initial(dcid)[:1199]) is None  # under the minimum datagram
    assert parse_initial(_initial(dcid, first=0x43)) is None  # short header
    assert parse_initial(_initial(dcid, first=0xE3)) is None  # Handshake
    assert parse_initial(_initial(dcid, first=0xF3)) is None  # Retry
    assert parse_initial(_initial(dcid, version=0x6B3343CF)) is None  # QUIC v2
    assert parse_initial(_initial(dcid, version=0)) is None  # version negotiation
    assert parse_initial(_initial(os.urandom(7))) is None  # a client's first id is >= 8 bytes
    assert parse_initial(_initial(os.urandom(21))) is None
    # A token length that runs past the packet (varint 0x7fff... = 1 GiB).
    packet = bytearray(_initial(dcid))
    packet[6 + 8 + 1 + 8 : 6 + 8 + 1 + 8 + 4] = b"\xbf\xff\xff\xff"
    assert parse_initial(bytes(packet)) is None


def test_a_token_in_the_header_is_read() -> None:
    header = parse_initial(_initial(os.urandom(8), token=b"x" * 45))
    assert header is not None and header.token == b"x" * 45


@given(st.binary(min_size=1, max_size=1400))
def test_random_bytes_never_raise(data: bytes) -> None:
    parse_initial(data)
    parse_initial(data + bytes(1200))
    parse_initial(b"\xc0\x00\x00\x00\x01" + data + bytes(1200))


# --- the Retry packet ------------------------------------------------------------------------


def test_retry_matches_the_rfc_9001_test_vector() -> None:
    # RFC 9001, appendix A.4.
    packet = encode_retry(
        1,
        dcid=b"",
        scid=bytes.fromhex("f067a5502a4262b5"),
        original_dcid=bytes.fromhex("8394c8f03e515708"),
        token=b"token",
        unused=0xF,
    )
    assert packet == bytes.fromhex(
        "ff000000010008f067a5502a4262b5746f6b656e04a265ba2eff4d829058fb3f0f2496ba"
    )


def test_a_retry_round_trip_completes_a_handshake_without_sockets() -> None:
    """qh3's client takes our Retry; its next Initial carries a token we accept; a server
    connection made from the token finishes the handshake (transport parameters agree)."""
    tokens = RetryTokens(os.urandom(32), clock=FakeClock())
    client, flight = _first_flight()
    first = parse_initial(flight[0])
    assert first is not None
    retry_scid = os.urandom(8)
    token = tokens.mint(CLIENT, first.dcid, retry_scid)
    retry = encode_retry(1, first.scid, retry_scid, first.dcid, token)
    assert len(retry) < len(flight[0])  # never an amplifier
    client.receive_datagram(retry, SERVER, now=0.01)
    again = [data for data, _ in client.datagrams_to_send(now=0.01)]
    second = parse_initial(again[0])
    assert second is not None
    assert second.dcid == retry_scid and second.token == token
    original = tokens.check(CLIENT, second.token, second.dcid)
    assert original == first.dcid

    assert isinstance(original, bytes)
    server = QuicConnection(
        configuration=server_configuration(Identity.generate()),
        original_destination_connection_id=original,
        retry_source_connection_id=second.dcid,
    )
    done = {"client": False, "server": False}
    now = 0.02
    to_server = again
    for _ in range(20):
        for data in to_server:
            server.receive_datagram(data, CLIENT, now)
        for data, _ in server.datagrams_to_send(now):
            client.receive_datagram(data, SERVER, now)
        to_server = [data for data, _ in client.datagrams_to_send(now)]
        for name, conn in (("client", client), ("server", server)):
            while (event := conn.next_event()) is not None:
                assert not isinstance(event, qe.ConnectionTerminated), event
                if isinstance(event, qe.HandshakeCompleted):
                    done[name] = True
        if all(done.values()):
            break
        now += 0.01
    assert done == {"client": True, "server": True}


# --- tokens -------------------------------------------------------------------------------


def test_a_token_vouches_for_the_original_id_from_its_address_only() -> None:
    tokens = RetryTokens(os.urandom(32), clock=FakeClock())
    original, retry_scid = os.urandom(8), os.urandom(8)
    token = tokens.mint(CLIENT, original, retry_scid)
    assert tokens.check(CLIENT, token, retry_scid) == original
    assert tokens.check(("198.51.100.8", CLIENT[1]), token, retry_scid) is DropReason.BAD_TOKEN
    assert tokens.check((CLIENT[0], CLIENT[1] + 1), token, retry_scid) is DropReason.BAD_TOKEN
    # Sent to another connection id than the one its Retry gave.
    assert tokens.check(CLIENT, token, os.urandom(8)) is DropReason.BAD_TOKEN


def test_a_forged_token_is_refused() -> None:
    tokens = RetryTokens(os.urandom(32), clock=FakeClock())
    original, retry_scid = os.urandom(8), os.urandom(8)
    token = tokens.mint(CLIENT, original, retry_scid)
    for index in range(len(token)):
        forged = bytearray(token)
        forged[index] ^= 0x01
        assert tokens.check(CLIENT, bytes(forged), retry_scid) is DropReason.BAD_TOKEN
    # Minted with another endpoint's secret (another agent, or this one before a restart).
    other = RetryTokens(os.urandom(32), clock=FakeClock())
    foreign = other.mint(CLIENT, original, retry_scid)
    assert tokens.check(CLIENT, foreign, retry_scid) is DropReason.BAD_TOKEN


def test_a_token_expires() -> None:
    clock = FakeClock()
    tokens = RetryTokens(os.urandom(32), clock=clock)
    original, retry_scid = os.urandom(8), os.urandom(8)
    token = tokens.mint(CLIENT, original, retry_scid)
    clock.now += TOKEN_LIFETIME - 0.01
    assert tokens.check(CLIENT, token, retry_scid) == original
    clock.now += 0.02
    assert tokens.check(CLIENT, token, retry_scid) is DropReason.EXPIRED_TOKEN


@given(st.binary(max_size=80))
def test_any_token_bytes_are_refused_without_raising(token: bytes) -> None:
    tokens = RetryTokens(b"k" * 32, clock=FakeClock())
    assert tokens.check(CLIENT, token, b"12345678") is DropReason.BAD_TOKEN
