"""The FEC codec: repairs byte-exactly what parity allows, gives up the rest in
bounded time and memory, and refuses hostile frames without raising; frames that
are not authentic (forged, changed, truncated, of the other direction or another
link, far from the sender's groups) change nothing but a counter."""

from __future__ import annotations

import itertools
import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from gpumesh.protocol import fec
from gpumesh.protocol.fec import DATA, PARITY, Decoder, Encoder, FecKeys, Sealer

KEYS = FecKeys.derive(bytes(32), from_client=True)
"""The keys of one direction of a link (any secret does for the codec's own tests)."""


def _frame(marker: int, seq: int, byte: int, payload: bytes) -> bytes:
    """An authentic frame of group ``seq`` (header byte ``byte``) around ``payload``:
    what a peer that holds the keys could send, however odd."""
    sealer = Sealer(KEYS)
    return sealer.tag(seq, struct.pack("!BIB", marker, sealer.group_id(seq), byte) + payload)


def _group(datagrams: list[bytes], now: float = 0.0) -> list[bytes]:
    encoder = Encoder(KEYS, group_size=len(datagrams))
    frames = encoder.encode(datagrams, now)
    assert len(frames) == len(datagrams) + 2  # a full group closes with P and Q
    return frames


datagram_lists = st.lists(st.binary(min_size=1, max_size=1452), min_size=3, max_size=20)
"""Groups of three or more: those get both parities (smaller ones, see below)."""


@settings(max_examples=200, deadline=None)
@given(datagrams=datagram_lists, data=st.data())
def test_any_two_losses_in_a_group_are_repaired_byte_exactly(
    datagrams: list[bytes], data: st.DataObject
) -> None:
    frames = _group(datagrams)
    lost = data.draw(
        st.sets(st.integers(0, len(frames) - 1), max_size=2), label="lost frame indexes"
    )
    decoder = Decoder(KEYS)
    passed: list[bytes] = []
    for i, frame in enumerate(frames):
        if i not in lost:
            passed += decoder.receive(frame, 0.0)
    assert sorted(passed) == sorted(datagrams)
    lost_data = sum(1 for i in lost if i < len(datagrams))
    assert decoder.counters.repaired == lost_data
    # Without any parity the decoder cannot know the group is whole: it stays open
    # (bounded by max_groups) until newer groups push it out.
    assert decoder.open_groups == (1 if lost == {len(datagrams), len(datagrams) + 1} else 0)
    assert decoder.held == 0


def test_datagrams_pass_up_at_once_and_in_order_without_loss() -> None:
    encoder, decoder = Encoder(KEYS), Decoder(KEYS)
    datagrams = [bytes([i]) * (100 + i) for i in range(40)]
    passed: list[bytes] = []
    for datagram in datagrams:
        for frame in encoder.encode([datagram], 0.0):
            out = decoder.receive(frame, 0.0)
            if frame[0] == DATA:
                assert out == [datagram]  # never held back when nothing is missing
            passed += out
    assert passed == datagrams
    assert decoder.counters.held == 0


def test_a_gap_holds_the_later_datagrams_until_the_repair_then_releases_them_in_order() -> None:
    datagrams = [bytes([i]) * 50 for i in range(16)]
    frames = _group(datagrams)
    decoder = Decoder(KEYS)
    passed: list[bytes] = []
    for i, frame in enumerate(frames):
        if i == 3:
            continue
        out = decoder.receive(frame, 0.0)
        if 3 < i < 16:
            assert out == []  # QUIC must not see later packets ahead of a repairable gap
        passed += out
    assert passed == datagrams  # the repaired one first, then those held behind it
    assert decoder.counters.repaired == 1
    assert decoder.counters.held == 12


def test_more_losses_than_parity_are_given_up_after_the_bound() -> None:
    datagrams = [bytes([i]) * 80 for i in range(16)]
    frames = _group(datagrams)
    decoder = Decoder(KEYS, hold_time=0.05)
    passed: list[bytes] = []
    for i, frame in enumerate(frames):
        if i not in (1, 2, 3):
            passed += decoder.receive(frame, 1.0)
    assert decoder.hold_until() == 1.05
    assert decoder.poll(1.049) == []
    passed += decoder.poll(1.05)
    assert passed == [d for i, d in enumerate(datagrams) if i not in (1, 2, 3)]
    assert decoder.counters.given_up == 1
    assert decoder.counters.repaired == 0
    assert decoder.open_groups == 0
    assert decoder.hold_until() is None


def test_a_group_not_full_is_closed_after_the_flush_delay() -> None:
    encoder = Encoder(KEYS, flush_delay=0.01)
    request = b"r" * 200
    frames = encoder.encode([request], 5.0)
    assert len(frames) == 1
    assert encoder.flush_at() == 5.01
    assert encoder.poll(5.0) == []
    parity = encoder.poll(5.01)
    assert [frame[0] for frame in parity] == [PARITY]  # a group of one: P alone
    assert encoder.flush_at() is None
    decoder = Decoder(KEYS)
    assert decoder.receive(parity[0], 5.02) == [request]  # the lone datagram rebuilt


def test_a_lone_acknowledgement_gets_no_parity_and_passes_up_at_once() -> None:
    encoder, decoder = Encoder(KEYS, flush_delay=0.01), Decoder(KEYS)
    passed: list[bytes] = []
    for i in range(100):  # an idle long link: one ACK or keep-alive per group
        ack = bytes([i]) * fec.SMALL
        frames = encoder.encode([ack], float(i)) + encoder.poll(i + 0.01)
        assert len(frames) == 1 and frames[0][0] == DATA  # the datagram, nothing more
        passed += decoder.receive(frames[0], i + 0.02)
        assert passed[-1] == ack
    assert encoder.counters.sent_parity == 0 and encoder.counters.unprotected == 100
    assert decoder.held == 0 and decoder.open_groups <= fec.MAX_GROUPS
    # One byte longer is no acknowledgement: it gets its P.
    assert len(encoder.encode([b"x" * (fec.SMALL + 1)], 200.0) + encoder.flush()) == 2


@settings(max_examples=100, deadline=None)
@given(datagrams=st.lists(st.binary(min_size=1, max_size=1452), min_size=1, max_size=2))
def test_a_group_of_one_or_two_gets_one_parity_that_rebuilds_either(
    datagrams: list[bytes],
) -> None:
    encoder = Encoder(KEYS, group_size=len(datagrams))
    frames = encoder.encode(datagrams, 0.0)
    if len(datagrams) == 1 and len(datagrams[0]) <= fec.SMALL:
        assert frames == [_frame(DATA, 0, 0, datagrams[0])]
        return
    assert [frame[0] for frame in frames] == [DATA] * len(datagrams) + [PARITY]
    for lost in range(len(datagrams)):
        decoder = Decoder(KEYS)
        passed: list[bytes] = []
        for i, frame in enumerate(frames):
            if i != lost:
                passed += decoder.receive(frame, 0.0)
        assert sorted(passed) == sorted(datagrams)
        assert decoder.counters.repaired == 1 and decoder.open_groups == 0


def test_memory_is_bounded_per_peer() -> None:
    decoder = Decoder(KEYS, max_groups=8, max_held=32)
    for gid in range(1000):
        # index 5 of each group: a gap below it every time
        decoder.receive(_frame(DATA, gid, 5, b"x" * 1000), float(gid))
        assert decoder.open_groups <= 8
        assert decoder.held <= 32


def test_stored_bytes_are_bounded_per_peer() -> None:
    decoder = Decoder(KEYS, max_stored=100_000)
    for gid in range(200):
        for index in range(fec.MAX_K):  # groups as large as the header allows, never closed
            decoder.receive(_frame(DATA, gid, index, b"x" * 1400), 0.0)
            assert decoder.stored <= 100_000 + 1400


@settings(max_examples=300, deadline=None)
@given(frame=st.binary(max_size=1600))
def test_hostile_frames_never_raise(frame: bytes) -> None:
    decoder = Decoder(KEYS)
    for marker in (DATA, PARITY):
        decoder.receive(bytes([marker]) + frame[1:], 0.0)
        decoder.receive(frame, 0.0)
    decoder.poll(10.0)


def test_hostile_frames_are_counted_and_dropped() -> None:
    decoder = Decoder(KEYS)
    bad = [
        b"",
        bytes([DATA]),
        _frame(DATA, 1, 63, b"x"),  # index out of range
        _frame(DATA, 1, 0, b"x" * (fec.MAX_PAYLOAD + 1)),  # oversized
        _frame(PARITY, 1, 0, b"xyz"),  # k = 0
        _frame(PARITY, 1, 2 << 6 | 4, b"xyz"),  # a third parity
        _frame(PARITY, 1, 4, b"x" * 2000),  # oversized parity
        _frame(0x3E, 1, 0, b"x"),  # not a frame type
        _frame(DATA, 1, 0, b"x")[:-1],  # truncated: the tag cut short
    ]
    for frame in bad:
        assert decoder.receive(frame, 0.0) == []
    assert decoder.counters.dropped == len(bad)


def test_parity_that_does_not_add_up_is_dropped_not_trusted() -> None:
    decoder = Decoder(KEYS)
    decoder.receive(_frame(DATA, 9, 0, b"a"), 0.0)
    # P for k=2 claiming the missing datagram is 65535 bytes long
    assert decoder.receive(_frame(PARITY, 9, 2, b"\xff\xff\x00"), 0.0) == []
    assert decoder.counters.dropped == 1


def test_a_later_group_repaired_during_a_hold_waits_behind_the_held_datagrams() -> None:
    # Group 1 loses three datagrams (more than parity rebuilds), so the decoder holds
    # what follows until it gives the group up. Group 2 loses one, which its parity
    # rebuilds meanwhile: passed up at once, it would reach QUIC ahead of every held
    # datagram of group 2, and QUIC would declare all of those lost.
    encoder = Encoder(KEYS, group_size=16)
    first = [bytes([1, i]) * 40 for i in range(16)]
    second = [bytes([2, i]) * 40 for i in range(16)]
    frames = encoder.encode(first, 0.0) + encoder.encode(second, 0.0)
    assert len(frames) == 36
    lost = {2, 3, 4, 18 + 5}
    decoder = Decoder(KEYS, hold_time=0.05)
    passed: list[bytes] = []
    for i, frame in enumerate(frames):
        if i not in lost:
            out = decoder.receive(frame, 1.0)
            if i > 4:
                assert out == []  # everything after group 1's gap waits, rebuilt or not
            passed += out
    assert decoder.counters.repaired == 1
    passed += decoder.poll(1.05)
    assert passed == [d for i, d in enumerate(first) if i not in (2, 3, 4)] + second
    assert decoder.counters.given_up == 1
    assert decoder.held == 0


def test_an_earlier_group_repaired_during_a_hold_passes_up_at_once() -> None:
    # Group 1 misses its last datagram, which only its parity reveals; group 2's gap
    # has started a hold by then. Group 1's rebuilt datagram comes before everything
    # held, so it goes up at once.
    encoder = Encoder(KEYS, group_size=4)
    first = [bytes([1, i]) * 40 for i in range(4)]
    second = [bytes([2, i]) * 40 for i in range(4)]
    f1, f2 = encoder.encode(first, 0.0), encoder.encode(second, 0.0)
    decoder = Decoder(KEYS)
    passed: list[bytes] = []
    for frame in f1[:3]:  # group 1's last datagram and its parity are late
        passed += decoder.receive(frame, 0.0)
    passed += decoder.receive(f2[0], 0.0)
    assert decoder.receive(f2[2], 0.0) == []  # group 2's index 1 is missing: a hold
    assert decoder.receive(f1[4], 0.0) == [first[3]]  # group 1's P rebuilds it at once
    passed.append(first[3])
    for frame in (f2[3], f2[4], f2[5]):
        passed += decoder.receive(frame, 0.0)
    assert passed == [*first[:3], second[0], first[3], *second[1:]]


# --- authentication ----------------------------------------------------------------

OTHER_KEYS = FecKeys.derive(bytes(32), from_client=False)
"""The keys of the other direction of the same link."""


def _forgeries(wire_id: int, size: int) -> list[bytes]:
    """What someone who knows a group's wire id but not the keys sends for it: a data
    frame for every index and both parities, with tags that cannot be right."""
    forged = [
        struct.pack("!BIB", DATA, wire_id, index) + b"\x00" * size + bytes(fec.TAG)
        for index in range(fec.GROUP_SIZE)
    ]
    return forged + [
        struct.pack("!BIB", PARITY, wire_id, which << 6 | fec.GROUP_SIZE)
        + b"\x00" * (size + 2)
        + _not_a_tag(fec.TAG)
        for which in (0, 1)
    ]


def _not_a_tag(size: int) -> bytes:
    """Bytes that are no frame's tag (any do: the forger cannot compute one)."""
    return bytes((7 * i + 3) & 0xFF for i in range(size))


def test_forged_frames_for_every_upcoming_group_change_nothing() -> None:
    # The worst case: the forger knows every upcoming wire id (it cannot: see the
    # next test) and gets its frames in ahead of the real ones, with a loss in each
    # group that the real parity must repair.
    encoder, decoder = Encoder(KEYS), Decoder(KEYS)
    sealer = Sealer(KEYS)
    datagrams = [bytes([i % 251]) * 1200 for i in range(20 * fec.GROUP_SIZE)]
    passed: list[bytes] = []
    forged = 0
    for group in range(20):
        for frame in _forgeries(sealer.group_id(group), 1200):
            assert decoder.receive(frame, 0.0) == []
            forged += 1
        chunk = datagrams[group * fec.GROUP_SIZE : (group + 1) * fec.GROUP_SIZE]
        frames = encoder.encode(chunk, 0.0)
        for i, frame in enumerate(frames):
            if i != 3:
                passed += decoder.receive(frame, 0.0)
    assert passed == datagrams
    assert decoder.counters.repaired == 20
    assert decoder.counters.forged == forged == decoder.counters.dropped
    assert decoder.open_groups == 0 and decoder.held == 0


def test_group_ids_do_not_count_up_and_differ_per_direction() -> None:
    ours, theirs = Sealer(KEYS), Sealer(OTHER_KEYS)
    ids = [ours.group_id(seq) for seq in range(1000)]
    assert len(set(ids)) == 1000
    steps = {(b - a) & 0xFFFFFFFF for a, b in itertools.pairwise(ids)}
    assert len(steps) > 990  # no constant step to guess the next one from
    assert sum(1 for seq in range(1000) if theirs.group_id(seq) == ids[seq]) <= 1


@settings(max_examples=200, deadline=None)
@given(seq=st.integers(0, 0xFFFFFFFF))
def test_the_group_id_permutation_inverts(seq: int) -> None:
    sealer = Sealer(KEYS)
    assert sealer.sequence(sealer.group_id(seq)) == seq


def test_a_frame_changed_anywhere_is_dropped_as_forged() -> None:
    encoder = Encoder(KEYS, group_size=3)
    frames = encoder.encode([b"a" * 100, b"b" * 90, b"c" * 120], 0.0)
    for frame in frames:
        for at in range(len(frame)):
            decoder = Decoder(KEYS)
            changed = bytearray(frame)
            changed[at] ^= 0x01
            assert decoder.receive(bytes(changed), 0.0) == []
            assert decoder.counters.dropped == 1
        untouched = Decoder(KEYS)
        untouched.receive(frame, 0.0)
        assert untouched.counters.dropped == 0


def test_frames_of_the_other_direction_or_another_link_are_forged() -> None:
    frames = Encoder(KEYS, group_size=2).encode([b"x" * 200, b"y" * 200], 0.0)
    for keys in (OTHER_KEYS, FecKeys.derive(b"\x01" * 32, from_client=True)):
        decoder = Decoder(keys)
        for frame in frames:
            assert decoder.receive(frame, 0.0) == []
        assert decoder.counters.forged == len(frames)


def test_sequence_numbers_carry_across_the_32_bit_wrap() -> None:
    assert fec._widen(5, (1 << 32) - 3) == (1 << 32) + 5
    assert fec._widen(0xFFFFFFFE, (1 << 32) + 2) == 0xFFFFFFFE
    assert fec._widen(7, 3) == 7
    assert fec._widen(0xFFFFFFF0, 3) == 0xFFFFFFF0  # nothing below 0


def test_a_group_far_from_the_senders_sequence_is_refused_before_its_tag() -> None:
    decoder = Decoder(KEYS)
    far = _frame(DATA, (1 << 16) + 1, 0, b"x" * 100)  # authentic, but a million datagrams on
    assert decoder.receive(far, 0.0) == []
    assert decoder.counters.forged == 1
    assert decoder.receive(_frame(DATA, 1 << 16, 0, b"y" * 100), 0.0) == [b"y" * 100]


def test_a_replayed_frame_of_a_group_far_behind_opens_no_group() -> None:
    decoder = Decoder(KEYS, max_groups=8)
    old = _frame(DATA, 0, 5, b"o" * 100)  # a gap below it: its group would stay open
    decoder.receive(old, 0.0)
    assert decoder.open_groups == 1
    decoder.receive(_frame(DATA, 5000, 0, b"n" * 100), 1.0)
    open_before = decoder.open_groups
    assert decoder.receive(old, 2.0) == []  # recorded long ago, sent again
    assert decoder.open_groups == open_before and decoder.counters.forged == 1
