"""How the relay joins packets read one by one into runs (``relay/server._joined``)."""

from __future__ import annotations

from gpumesh.protocol.relay import KeepAlive, encode_data, encode_packet
from gpumesh.relay.server import _joined
from gpumesh.transport.udp import Received

A = ("192.0.2.1", 1000)
B = ("192.0.2.2", 2000)


def _one(data: bytes, source: tuple[str, int] = A) -> Received:
    return Received(data, len(data), source)


def test_one_sources_data_packets_of_one_session_and_size_become_one_run() -> None:
    packets = [encode_data(7, bytes([n]) * 100) for n in range(5)]
    assert _joined([_one(p) for p in packets]) == [(b"".join(packets), len(packets[0]), A)]


def test_a_shorter_packet_ends_a_run_and_order_is_kept() -> None:
    long, short = encode_data(7, b"x" * 100), encode_data(7, b"y" * 10)
    after = encode_data(7, b"z" * 100)
    joined = _joined([_one(long), _one(long), _one(short), _one(after)])
    assert joined == [(long + long + short, len(long), A), (after, len(after), A)]


def test_another_source_session_or_a_control_packet_breaks_a_run() -> None:
    first, other_session = encode_data(7, b"a" * 50), encode_data(8, b"b" * 50)
    control = encode_packet(KeepAlive(seq=1))
    batch = [_one(first), _one(first, B), _one(other_session), _one(control), _one(first)]
    assert [item[0] for item in _joined(batch)] == [first, first, other_session, control, first]
    assert [item[2] for item in _joined(batch)] == [A, B, A, A, A]


def test_a_buffer_read_with_receive_offload_stays_as_it_came() -> None:
    packet = encode_data(7, b"a" * 50)
    gro = Received(packet * 3, len(packet), A)
    assert _joined([_one(packet), gro, _one(packet)]) == [
        (packet, len(packet), A),
        (packet * 3, len(packet), A),
        (packet, len(packet), A),
    ]


def test_a_run_stops_at_the_kernels_segment_limit() -> None:
    packet = encode_data(7, b"a" * 100)
    joined = _joined([_one(packet)] * 70)
    assert [len(buffer) // len(packet) for buffer, _, _ in joined] == [64, 6]
