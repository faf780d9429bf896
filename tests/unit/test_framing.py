"""protocol/framing: frames encode and reassemble from any split; limits hold before bodies."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpumesh.errors import FrameTooLargeError, ProtocolError
from gpumesh.protocol.framing import (
    HEADER_SIZE,
    Frame,
    FrameDecoder,
    FrameKind,
    encode_frame,
    encode_header,
)
from gpumesh.protocol.messages import MAX_DATA_FRAME, MAX_MESSAGE_FRAME

LIMITS = {FrameKind.MESSAGE: MAX_MESSAGE_FRAME, FrameKind.DATA: MAX_DATA_FRAME, FrameKind.CREDIT: 8}

frames = st.one_of(
    st.builds(Frame, st.just(FrameKind.MESSAGE), st.binary(max_size=300)),
    st.builds(Frame, st.just(FrameKind.DATA), st.binary(max_size=300)),
    st.builds(Frame, st.just(FrameKind.CREDIT), st.binary(min_size=8, max_size=8)),
)


def _stream(items: list[Frame]) -> bytes:
    return b"".join(encode_frame(f.kind, f.body) for f in items)


def test_header_layout_is_kind_then_big_endian_length() -> None:
    assert HEADER_SIZE == 5
    assert encode_frame(FrameKind.DATA, b"abc") == b"\x02\x00\x00\x00\x03abc"
    assert encode_header(FrameKind.MESSAGE, 258) == b"\x01\x00\x00\x01\x02"


def test_encode_frame_accepts_a_memoryview() -> None:
    assert encode_frame(FrameKind.DATA, memoryview(b"xy")) == encode_frame(FrameKind.DATA, b"xy")


def test_one_whole_frame_decodes() -> None:
    decoder = FrameDecoder()
    assert decoder.feed(encode_frame(FrameKind.MESSAGE, b"hi")) == [Frame(FrameKind.MESSAGE, b"hi")]
    assert decoder.at_frame_boundary()
    assert decoder.buffered == 0


def test_an_empty_data_frame_survives() -> None:
    assert FrameDecoder().feed(encode_frame(FrameKind.DATA, b"")) == [Frame(FrameKind.DATA, b"")]


@given(st.lists(frames, max_size=8))
def test_frames_fed_byte_by_byte_reassemble(items: list[Frame]) -> None:
    decoder = FrameDecoder()
    out: list[Frame] = []
    for byte in _stream(items):
        out += decoder.feed(bytes([byte]))
    assert out == items
    assert decoder.at_frame_boundary()


@given(st.lists(frames, max_size=8), st.data())
def test_frames_fed_in_random_splits_reassemble(items: list[Frame], data: st.DataObject) -> None:
    stream = _stream(items)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    decoder = FrameDecoder()
    out: list[Frame] = []
    for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        out += decoder.feed(stream[start:end])
    assert out == items
    assert decoder.at_frame_boundary()


def test_partial_frame_stays_buffered_until_complete() -> None:
    decoder = FrameDecoder()
    data = encode_frame(FrameKind.DATA, b"hello")
    assert decoder.feed(data[:7]) == []
    assert not decoder.at_frame_boundary()
    assert decoder.buffered == 7
    assert decoder.feed(data[7:]) == [Frame(FrameKind.DATA, b"hello")]
    assert decoder.at_frame_boundary()


@pytest.mark.parametrize("kind", list(FrameKind))
def test_header_over_the_limit_is_refused_before_the_body(kind: FrameKind) -> None:
    decoder = FrameDecoder()
    header = struct.pack("!BI", kind, LIMITS[kind] + 1)
    with pytest.raises(FrameTooLargeError, match=str(LIMITS[kind])):
        decoder.feed(header)


def test_header_at_the_limit_waits_for_the_body() -> None:
    decoder = FrameDecoder()
    assert decoder.feed(struct.pack("!BI", FrameKind.MESSAGE, MAX_MESSAGE_FRAME)) == []
    assert decoder.feed(b"x" * MAX_MESSAGE_FRAME) == [
        Frame(FrameKind.MESSAGE, b"x" * MAX_MESSAGE_FRAME)
    ]


def test_huge_length_after_a_good_frame_is_refused() -> None:
    data = encode_frame(FrameKind.DATA, b"ok") + struct.pack("!BI", FrameKind.DATA, 2**32 - 1)
    with pytest.raises(FrameTooLargeError):
        FrameDecoder().feed(data)


@pytest.mark.parametrize("kind", [0, 4, 255])
def test_unknown_kind_is_a_protocol_error(kind: int) -> None:
    with pytest.raises(ProtocolError, match=f"unknown frame kind {kind}"):
        FrameDecoder().feed(struct.pack("!BI", kind, 0))


@pytest.mark.parametrize("kind", list(FrameKind))
def test_encode_frame_refuses_oversize_bodies(kind: FrameKind) -> None:
    encode_frame(kind, b"x" * LIMITS[kind])
    with pytest.raises(FrameTooLargeError):
        encode_frame(kind, b"x" * (LIMITS[kind] + 1))


def test_encode_header_refuses_oversize_lengths() -> None:
    with pytest.raises(FrameTooLargeError):
        encode_header(FrameKind.DATA, MAX_DATA_FRAME + 1)
