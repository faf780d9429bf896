"""Sealed frames (the desktop connection's framing after TLS): what opens and what is refused."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumesh.protocol.handshake import BINDING_SIZE
from gpumesh.transport import sealing
from gpumesh.transport.sealing import (
    HEADER,
    MAX_PLAIN,
    RANDOM_BYTES,
    TAG,
    Opener,
    ReadFailed,
    Sealer,
    SealError,
    SendFailed,
    derive_keys,
)

payloads = st.lists(st.binary(min_size=1, max_size=4096), min_size=1, max_size=12)
splits = st.lists(st.integers(min_value=1, max_value=9000), min_size=1, max_size=30)


def _pair() -> tuple[Sealer, Opener, Sealer, Opener]:
    """Both directions of one connection: (dialler's sealer, acceptor's opener,
    acceptor's sealer, dialler's opener)."""
    up, down = derive_keys(
        os.urandom(RANDOM_BYTES), os.urandom(RANDOM_BYTES), os.urandom(BINDING_SIZE)
    )
    return Sealer(up), Opener(up), Sealer(down), Opener(down)


def _open_all(opener: Opener) -> list[bytes]:
    out = memoryview(bytearray(MAX_PLAIN))
    opened = []
    while (size := opener.open_into(out)) is not None:
        opened.append(bytes(out[:size]))
        if not size:
            break
    return opened


def _deliver(opener: Opener, wire: bytes, cuts: list[int]) -> list[bytes]:
    """Feed ``wire`` through :meth:`Opener.room` in pieces of the sizes in ``cuts``
    (the last repeated), opening what is whole after each piece."""
    opened: list[bytes] = []
    pos, index = 0, 0
    while pos < len(wire):
        size = cuts[min(index, len(cuts) - 1)]
        index += 1
        room = opener.room()
        take = min(size, len(room), len(wire) - pos)
        room[:take] = wire[pos : pos + take]
        opener.filled(take)
        pos += take
        opened += _open_all(opener)
    return opened


@settings(max_examples=60, deadline=None)
@given(payloads, splits)
def test_frames_round_trip_however_the_bytes_arrive(messages: list[bytes], cuts: list[int]) -> None:
    sealer, opener, _, _ = _pair()
    wire = b"".join(sealer.seal(m) for m in messages) + sealer.seal(b"")
    assert _deliver(opener, wire, cuts) == [*messages, b""]
    assert opener.ended
    opener.cut()  # its end was sealed: an EOF now is no error


@settings(max_examples=60, deadline=None)
@given(payloads, st.data())
def test_a_changed_byte_is_refused(messages: list[bytes], data: st.DataObject) -> None:
    sealer, opener, _, _ = _pair()
    wire = bytearray(b"".join(sealer.seal(m) for m in messages))
    where = data.draw(st.integers(min_value=0, max_value=len(wire) - 1))
    wire[where] ^= data.draw(st.integers(min_value=1, max_value=255))
    with pytest.raises(SealError):
        opener.feed(bytes(wire))
        _open_all(opener)
        opener.cut()  # a length made larger only waits for bytes that never come


@settings(max_examples=40, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=512), min_size=2, max_size=8), st.data())
def test_reordered_replayed_or_dropped_frames_are_refused(
    messages: list[bytes], data: st.DataObject
) -> None:
    sealer, opener, _, _ = _pair()
    frames = [sealer.seal(m) for m in messages]
    i = data.draw(st.integers(min_value=0, max_value=len(frames) - 2))
    how = data.draw(st.sampled_from(["swap", "replay", "drop"]))
    if how == "swap":
        frames[i], frames[i + 1] = frames[i + 1], frames[i]
    elif how == "replay":
        frames.insert(i + 1, frames[i])
    else:
        del frames[i]
    opener.feed(b"".join(frames))
    with pytest.raises(SealError, match="authentication"):
        _open_all(opener)


@settings(max_examples=40, deadline=None)
@given(payloads, st.data())
def test_a_stream_cut_short_is_refused(messages: list[bytes], data: st.DataObject) -> None:
    sealer, opener, _, _ = _pair()
    wire = b"".join(sealer.seal(m) for m in messages) + sealer.seal(b"")
    keep = data.draw(st.integers(min_value=0, max_value=len(wire) - 1))
    opener.feed(wire[:keep])
    opened = _open_all(opener)
    assert opened == messages[: len(opened)]  # what opened is genuine, and in order
    with pytest.raises(SealError, match="ended in the middle"):
        opener.cut()


def test_a_frame_of_one_direction_does_not_open_in_the_other() -> None:
    up, _, _, down_opener = _pair()
    down_opener.feed(up.seal(b"hello"))
    with pytest.raises(SealError, match="authentication"):
        _open_all(down_opener)


def test_another_connections_frame_does_not_open() -> None:
    sealer, _, _, _ = _pair()
    _, opener, _, _ = _pair()
    opener.feed(sealer.seal(b"hello"))
    with pytest.raises(SealError, match="authentication"):
        _open_all(opener)


def test_nothing_follows_the_end_of_the_stream() -> None:
    sealer, opener, _, _ = _pair()
    opener.feed(sealer.seal(b"") + b"x")
    with pytest.raises(SealError, match="followed the end"):
        _open_all(opener)
    with pytest.raises(SealError, match="follow the end"):
        sealer.seal(b"more")


def test_an_oversized_length_is_refused_before_any_wait() -> None:
    _, opener, _, _ = _pair()
    opener.feed((MAX_PLAIN + TAG + 1).to_bytes(HEADER, "big"))
    with pytest.raises(SealError, match="a frame of"):
        _open_all(opener)


def test_full_frames_pass_and_a_larger_plaintext_is_not_sealed() -> None:
    sealer, opener, _, _ = _pair()
    big = os.urandom(MAX_PLAIN)
    wire = sealer.seal(big) * 1 + sealer.seal(big[:7])
    assert _deliver(opener, wire, [65536, 1, 300000]) == [big, big[:7]]
    with pytest.raises(ValueError):
        sealer.seal(big + b"x")


def test_keys_move_on_in_step_and_a_wrapping_counter_ends_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sealing, "REKEY_FRAMES", 3)
    sealer, opener, _, _ = _pair()
    wire = b"".join(sealer.seal(bytes([n])) for n in range(10))
    assert _deliver(opener, wire, [5]) == [bytes([n]) for n in range(10)]
    # A frame sealed with the first key, sent where the third is due, is refused.
    sealer2, opener2, _, _ = _pair()
    first = sealer2.seal(b"a")
    frames = [sealer2.seal(b"b") for _ in range(6)]
    opener2.feed(first + b"".join(frames[:5]) + first)
    with pytest.raises(SealError, match="authentication"):
        _open_all(opener2)
    direction = sealer._direction  # where 2^96 frames would leave it: the last key's turn
    direction.counter = direction.until = (1 << 96) - sealing.REKEY_FRAMES
    with pytest.raises(SealError, match="wrap"):
        sealer.seal(b"x")


def test_keys_need_both_randoms_and_a_quic_session_binding_whole() -> None:
    binding = os.urandom(BINDING_SIZE)
    with pytest.raises(SealError):
        derive_keys(b"short", os.urandom(RANDOM_BYTES), binding)
    a, b = os.urandom(RANDOM_BYTES), os.urandom(RANDOM_BYTES)
    assert derive_keys(a, b, binding) != derive_keys(b, a, binding)
    up, down = derive_keys(a, b, binding)
    assert up != down
    # Another QUIC session's binding makes other keys from the same randoms.
    assert derive_keys(a, b, binding) != derive_keys(a, b, os.urandom(BINDING_SIZE))
    # No binding, or one of another size (version 1's tls-unique: under TLS 1.3 the
    # client Finished, 48 bytes with TLS_AES_256_GCM_SHA384), is refused.
    for wrong in (b"", os.urandom(12), os.urandom(48)):
        with pytest.raises(SealError, match="QUIC session binding"):
            derive_keys(a, b, wrong)


# --- the pumps: the same frames as a loop, given the calls that read and send -----------------


class _Reads:
    """A ``read_into`` that brings ``pieces`` one per call (cut to the room given),
    then nothing (an end); an OSError in ``pieces`` is raised at its turn."""

    def __init__(self, pieces: list[bytes | OSError]) -> None:
        self._pieces = list(pieces)
        self.calls = 0

    def __call__(self, room: memoryview) -> int:
        self.calls += 1
        if not self._pieces:
            return 0
        piece = self._pieces.pop(0)
        if isinstance(piece, OSError):
            raise piece
        take = min(len(piece), len(room))
        room[:take] = piece[:take]
        if take < len(piece):
            self._pieces.insert(0, piece[take:])
        return take


def _pieces(wire: bytes, cuts: list[int]) -> list[bytes | OSError]:
    pieces: list[bytes | OSError] = []
    pos, index = 0, 0
    while pos < len(wire):
        size = cuts[min(index, len(cuts) - 1)]
        pieces.append(wire[pos : pos + size])
        pos += size
        index += 1
    return pieces


def _pumped(sealer: Sealer, messages: list[bytes | OSError]) -> bytes:
    """What :meth:`Sealer.pump` sends for ``messages`` (one read each), its end sealed."""
    sent: list[bytes] = []
    sealer.pump(_Reads(messages), lambda frame: sent.append(bytes(frame)))
    return b"".join(sent) + sealer.seal(b"")


def _opened(opener: Opener, wire: bytes, cuts: list[int]) -> list[bytes]:
    got: list[bytes] = []
    opener.pump(_Reads(_pieces(wire, cuts)), lambda plain: got.append(bytes(plain)))
    return got


@settings(max_examples=60, deadline=None)
@given(payloads, splits)
def test_pumped_frames_are_the_frames_and_open_however_the_bytes_arrive(
    messages: list[bytes], cuts: list[int]
) -> None:
    up = os.urandom(16)
    wire = _pumped(Sealer(up), list(messages))
    # Byte for byte what seal_into makes (header, nonce from the counter, tag).
    reference = Sealer(up)
    assert wire == b"".join(reference.seal(m) for m in [*messages, b""])
    opener = Opener(up)
    assert _opened(opener, wire, cuts) == messages
    assert opener.ended
    assert _deliver(Opener(up), wire, cuts) == [*messages, b""]


def test_pumped_frames_keep_the_nonce_past_64_bits_and_the_keys_in_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sealing, "REKEY_FRAMES", 3)
    key = os.urandom(16)
    messages = [bytes([n]) * (n + 1) for n in range(10)]
    sealers, openers = (Sealer(key), Sealer(key)), (Opener(key), Opener(key))
    for end in (*sealers, *openers):
        direction = end._direction  # a counter about to carry into the nonce's high bits
        direction.counter, direction.until = (1 << 64) - 4, (1 << 64) - 2
    wire = _pumped(sealers[0], list(messages))
    assert wire == b"".join(sealers[1].seal(m) for m in [*messages, b""])
    assert _opened(openers[0], wire, [7]) == messages
    assert _deliver(openers[1], wire, [5]) == [*messages, b""]


def test_a_pumped_stream_refuses_what_open_into_refuses() -> None:
    key = os.urandom(16)
    sealer = Sealer(key)
    frames = [sealer.seal(b"a"), sealer.seal(b"b"), sealer.seal(b"c")]
    end = sealer.seal(b"")
    cases = {
        "changed": frames[0][:5] + bytes([frames[0][5] ^ 1]) + frames[0][6:] + end,
        "reordered": frames[1] + frames[0] + frames[2] + end,
        "replayed": frames[0] + frames[0] + end,
        "dropped": frames[0] + frames[2] + end,
        "cut": b"".join(frames),
        "cut mid-frame": b"".join(frames) + end[:7],
    }
    for name, wire in cases.items():
        for cuts in ([1], [4096]):
            with pytest.raises(SealError):
                _opened(Opener(key), wire, cuts)
                pytest.fail(f"{name} opened")
    # Bytes read with the end frame (the pump reads nothing after it).
    with pytest.raises(SealError, match="followed"):
        _opened(Opener(key), b"".join(frames) + end + b"x", [4096])


def test_a_pumped_oversized_length_is_refused_before_any_more_reads() -> None:
    reads = _Reads([(MAX_PLAIN + TAG + 1).to_bytes(HEADER, "big"), b"more"])
    with pytest.raises(SealError, match="at most"):
        Opener(os.urandom(16)).pump(reads, lambda plain: None)
    assert reads.calls == 1


def test_a_pump_says_which_call_failed() -> None:
    key = os.urandom(16)
    with pytest.raises(ReadFailed) as read:
        Sealer(key).pump(_Reads([b"a", ConnectionResetError(104, "reset")]), lambda f: None)
    assert isinstance(read.value.__cause__, ConnectionResetError)

    def refuse(data: memoryview) -> None:
        raise BrokenPipeError(32, "broken pipe")

    with pytest.raises(SendFailed):
        Sealer(key).pump(_Reads([b"a"]), refuse)
    with pytest.raises(SendFailed):
        Opener(key).pump(_Reads([Sealer(key).seal(b"a")]), refuse)
    with pytest.raises(ReadFailed):
        Opener(key).pump(_Reads([OSError(5, "io")]), lambda plain: None)
    ended = Sealer(key)
    ended.seal(b"")
    with pytest.raises(SealError):
        ended.pump(_Reads([b"a"]), lambda f: None)
