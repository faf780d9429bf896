"""The fuzzer's own parts: the msgpack writer, the strategies per struct, the oracles."""

from __future__ import annotations

from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumesh.protocol.messages import JobCancel, decode_message
from tests.fuzz.mpack import Lie, Nest, Wide, pack
from tests.fuzz.strategies import any_values, violations
from tests.fuzz.targets import (
    MESSAGE_SHAPES,
    MESSAGE_TYPES,
    RELAY_SHAPES,
    RELAY_TYPES,
    TARGETS,
    MemoryCeilingError,
    Meter,
)

FEW = settings(max_examples=10)


@given(any_values())
def test_pack_writes_what_msgspec_writes(tree: Any) -> None:
    assert pack(tree) == msgspec.msgpack.encode(tree)


@given(any_values())
def test_a_wide_header_decodes_to_the_same_value(tree: Any) -> None:
    decoded = msgspec.msgpack.decode(pack(Wide(tree)))
    assert msgspec.msgpack.encode(decoded) == msgspec.msgpack.encode(tree)


@given(st.text(max_size=40) | st.binary(max_size=40) | st.lists(st.none(), max_size=40), st.data())
def test_a_lying_header_is_caught_by_msgspec(value: Any, data: st.DataObject) -> None:
    real = len(value.encode()) if isinstance(value, str) else len(value)
    count = data.draw(st.integers(0, 2**32 - 1).filter(lambda n: n != real))
    with pytest.raises(msgspec.DecodeError):
        msgspec.msgpack.decode(pack(Lie(value, count)))


def test_deep_nesting_is_written_without_recursion() -> None:
    assert pack(Nest(None, 100_000)) == b"\x91" * 100_000 + b"\xc0"


def test_every_message_type_and_relay_packet_is_fuzzed() -> None:
    assert set(MESSAGE_SHAPES) == set(MESSAGE_TYPES) and len(MESSAGE_TYPES) > 30
    assert set(RELAY_SHAPES) == set(RELAY_TYPES) and len(RELAY_TYPES) > 10
    assert [t.name for t in TARGETS] == [
        "framing",
        "messages",
        "handshake-server",
        "handshake-client",
        "relay",
        "pairing-codes",
        "group-invites",
        "lan-announcements",
    ]


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda cls: cls.__name__)
@FEW
@given(data=st.data())
def test_valid_trees_of_each_message_decode_within_their_bounds(
    cls: type[Any], data: st.DataObject
) -> None:
    encoded = pack(data.draw(MESSAGE_SHAPES[cls].valid()))
    if len(encoded) <= 64 * 1024:
        message = decode_message(encoded)
        assert type(message) is cls
        assert violations(message, mi.type_info(cls)) == []


@pytest.mark.parametrize("cls", RELAY_TYPES, ids=lambda cls: cls.__name__)
@FEW
@given(data=st.data())
def test_valid_trees_of_each_relay_packet_decode(cls: type[Any], data: st.DataObject) -> None:
    packet = msgspec.msgpack.decode(pack(data.draw(RELAY_SHAPES[cls].valid())), type=cls)
    assert violations(packet, mi.type_info(cls)) == []


def test_violations_read_patterns_in_full_and_bounds() -> None:
    info = mi.type_info(JobCancel)
    assert violations(JobCancel(job_id="abcdefgh"), info) == []
    assert violations(JobCancel(job_id="abcdefgh\n"), info)  # what msgspec's $ let through
    assert violations(JobCancel(job_id="abc"), info)


def test_the_meter_fails_an_allocation_over_its_ceiling() -> None:
    meter = Meter()
    result, error = meter.run(1 << 20, "small", lambda: bytes(1000))
    assert result == bytes(1000) and error is None
    with pytest.raises(MemoryCeilingError, match="big allocated"):
        meter.run(1 << 20, "big", lambda: bytes(2 << 20))
    assert meter.peak >= 2 << 20


@given(st.just(None))
def test_the_meter_runs_at_the_default_recursion_limit_even_under_hypothesis(_: None) -> None:
    def down(n: int) -> int:
        return 0 if n == 0 else 1 + down(n - 1)

    _, error = Meter().run(1 << 20, "deep", lambda: down(1500))
    assert isinstance(error, RecursionError)
