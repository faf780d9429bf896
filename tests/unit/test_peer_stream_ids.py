"""transport/quic: PeerStreamIds, which decides whether a stream's frame opens a request."""

from __future__ import annotations

from gpumesh.transport.quic import PeerStreamIds


def test_streams_in_order_are_each_new_once() -> None:
    ids = PeerStreamIds()
    assert [ids.first_seen(i) for i in (0, 4, 8)] == [True, True, True]
    assert [ids.first_seen(i) for i in (0, 4, 8)] == [False, False, False]


def test_a_lower_stream_whose_first_frame_comes_late_is_still_new() -> None:
    # The proof on stream 0 and a request on stream 4 leave together; the packet
    # with stream 0 is lost and resent after stream 4's arrived.
    ids = PeerStreamIds()
    assert ids.first_seen(4)
    assert ids.first_seen(0)
    assert not ids.first_seen(0)
    assert ids.first_seen(12) and ids.first_seen(8)
    assert not any(ids.first_seen(i) for i in (0, 4, 8, 12))


def test_each_kind_of_stream_counts_on_its_own() -> None:
    ids = PeerStreamIds()
    assert ids.first_seen(8)  # client bidirectional
    assert ids.first_seen(2)  # client unidirectional: not below 8 in its own kind
    assert ids.first_seen(6)
    assert ids.first_seen(0) and ids.first_seen(4)
    assert not ids.first_seen(2)
