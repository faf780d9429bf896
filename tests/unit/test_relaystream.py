"""The relay's TCP stream, sans I/O: the HTTP/1.1 upgrade and the length-prefixed
frames (protocol/relaystream.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpumesh.errors import ProtocolError
from gpumesh.protocol import relaystream as rs
from gpumesh.protocol.relay import MAX_PACKET, hello_packet


def test_a_nodes_request_is_an_upgrade_and_a_browsers_is_not() -> None:
    assert rs.is_upgrade_request(rs.upgrade_request("relay.example.org:443"))
    assert not rs.is_upgrade_request(b"GET / HTTP/1.1\r\nHost: relay.example.org\r\n\r\n")
    websocket = (
        b"GET /gpumesh/relay HTTP/1.1\r\nHost: r\r\nConnection: Upgrade\r\n"
        b"Upgrade: websocket\r\n\r\n"
    )
    assert not rs.is_upgrade_request(websocket)
    no_connection = b"GET /gpumesh/relay HTTP/1.1\r\nHost: r\r\nUpgrade: gpumesh-relay/1\r\n\r\n"
    assert not rs.is_upgrade_request(no_connection)
    proxied = (
        b"GET /gpumesh/relay HTTP/1.1\r\nhost: r\r\nconnection: keep-alive, Upgrade\r\n"
        b"upgrade: GPUMESH-RELAY/1\r\n\r\n"
    )
    assert rs.is_upgrade_request(proxied)  # header names and tokens are case-insensitive
    assert not rs.is_upgrade_request(b"\x16\x03\x01garbage\r\n\r\n")
    assert not rs.is_upgrade_request(b"GET " + b"a" * rs.MAX_HEAD + b"\r\n\r\n")


def test_answers_are_read_for_their_status() -> None:
    assert rs.head_status(rs.UPGRADED) == (101, "101 Switching Protocols")
    assert rs.head_status(rs.NOT_FOUND)[0] == 404
    assert rs.head_status(b"HTTP/1.0 403 Forbidden\r\n\r\n") == (403, "403 Forbidden")
    for bad in (b"\r\n\r\n", b"SSH-2.0-OpenSSH\r\n\r\n", b"HTTP/1.1 abc\r\n\r\n"):
        with pytest.raises(ProtocolError):
            rs.head_status(bad)


def test_connect_asks_for_the_target_with_credentials_only_when_given() -> None:
    assert (
        rs.connect_request("relay:443") == b"CONNECT relay:443 HTTP/1.1\r\nHost: relay:443\r\n\r\n"
    )
    assert b"Proxy-Authorization: Basic dTpw\r\n" in rs.connect_request("relay:443", "Basic dTpw")


def test_frames_come_back_whole_however_the_stream_cuts_them() -> None:
    packets = [hello_packet(), b"\x0b" + bytes(range(256)) * 5, b"x"]
    data = rs.encode_frames(packets)
    for cut in range(1, 40):
        deframer = rs.Deframer()
        out = []
        for offset in range(0, len(data), cut):
            out += deframer.feed(data[offset : offset + cut])
        assert out == packets
        assert deframer.pending == 0


@given(st.lists(st.binary(min_size=1, max_size=MAX_PACKET), max_size=8), st.data())
def test_any_packets_split_anywhere_reassemble(packets: list[bytes], data: st.DataObject) -> None:
    stream = rs.encode_frames(packets)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    deframer = rs.Deframer()
    out: list[bytes] = []
    start = 0
    for cut in [*cuts, len(stream)]:
        out += deframer.feed(stream[start:cut])
        start = cut
    assert out == packets


def test_a_zero_or_oversized_frame_is_an_error_not_a_wait() -> None:
    with pytest.raises(ProtocolError):
        rs.Deframer().feed(b"\x00\x00")
    with pytest.raises(ProtocolError):
        rs.Deframer().feed((MAX_PACKET + 1).to_bytes(2, "big"))
    with pytest.raises(ProtocolError):
        rs.encode_frame(b"")
    with pytest.raises(ProtocolError):
        rs.encode_frame(b"x" * (MAX_PACKET + 1))
