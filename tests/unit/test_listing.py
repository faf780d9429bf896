"""protocol/listing: signed registry records round-trip, and any change is refused.

Tampering tests change one field of a decoded record and re-encode it with
the original signature (what a forging registry would send), or flip bytes of
the encoded record or of the signature: every variant must be refused.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpumesh.errors import ProtocolError
from gpumesh.identity.keys import Identity
from gpumesh.protocol.listing import (
    MAX_RECORD_BYTES,
    AddressRecord,
    GpuListing,
    Listing,
    SignedRecord,
    Withdrawal,
    check_fresh,
    open_record,
    record_kind,
    sign_record,
)

NOW = 1_700_000_000.0
GIB = 1 << 30
_IDENTITY = Identity.generate()
_OTHER = Identity.generate()


def listing(identity: Identity = _IDENTITY, **changes: Any) -> Listing:
    fields: dict[str, Any] = {
        "public_key": identity.public_key,
        "seq": 7,
        "timestamp": NOW,
        "name": "alice-pc",
        "gpus": [GpuListing("NVIDIA GeForce RTX 4090", 24 * GIB, 20 * GIB)],
        "idle": True,
        "region": "us-west",
        "contact": "matrix:@alice:example.org",
        "version": "0.1.0",
    }
    fields.update(changes)
    return Listing(**fields)


_SIGNED = sign_record(_IDENTITY, listing())
_RAW: dict[str, Any] = msgspec.msgpack.decode(_SIGNED.record)


def test_round_trip_of_each_kind() -> None:
    for record in (
        listing(),
        Withdrawal(_IDENTITY.public_key, 8, NOW),
        AddressRecord(_IDENTITY.public_key, 3, NOW, ["203.0.113.5:47000"], "relay.example:4799"),
    ):
        opened = open_record(sign_record(_IDENTITY, record))
        assert opened == record
        assert opened.node_id == _IDENTITY.node_id
    assert record_kind(listing()) == record_kind(Withdrawal(_IDENTITY.public_key, 1, NOW))
    assert record_kind(AddressRecord(_IDENTITY.public_key, 1, NOW, [])) == "addresses"


def test_json_form_carries_the_signed_bytes() -> None:
    wire = msgspec.json.encode(_SIGNED)
    assert open_record(msgspec.json.decode(wire, type=SignedRecord)) == listing()


# Replacement values of the right type for every field: a forger's edits.
_EDITS: dict[str, Any] = {
    "seq": 8,
    "timestamp": NOW + 1,
    "name": "mallory",
    "gpus": [{"name": "NVIDIA H100", "memory_total": 80 * GIB, "memory_free": 80 * GIB}],
    "idle": False,
    "region": "eu-west",
    "contact": "mallory@example.org",
    "version": "9.9.9",
    "addresses": ["198.51.100.1:47000"],
    "public_key": _OTHER.public_key,
}


@pytest.mark.parametrize("field", sorted(_EDITS))
def test_any_edited_field_is_refused(field: str) -> None:
    edited = dict(_RAW, **{field: _EDITS[field]})
    forged = SignedRecord(msgspec.msgpack.encode(edited), _SIGNED.signature)
    with pytest.raises(ProtocolError, match="does not verify"):
        open_record(forged)


def test_a_record_resigned_by_another_key_names_that_key() -> None:
    # Signed properly, but by someone else: it opens as *their* record, never alice's.
    theirs = sign_record(_OTHER, listing(_OTHER))
    assert open_record(theirs).node_id == _OTHER.node_id != _IDENTITY.node_id


@given(st.data())
def test_flipped_bytes_are_refused(data: st.DataObject) -> None:
    which = data.draw(st.sampled_from(["record", "signature"]))
    blob = bytearray(getattr(_SIGNED, which))
    index = data.draw(st.integers(0, len(blob) - 1))
    blob[index] ^= data.draw(st.integers(1, 255))
    tampered = SignedRecord(
        bytes(blob) if which == "record" else _SIGNED.record,
        bytes(blob) if which == "signature" else _SIGNED.signature,
    )
    with pytest.raises(ProtocolError):
        open_record(tampered)


@given(st.binary(max_size=300), st.binary(max_size=80))
def test_garbage_is_refused_with_a_protocol_error(record: bytes, signature: bytes) -> None:
    with pytest.raises(ProtocolError):
        open_record(SignedRecord(record, signature))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"seq": 0}, "sequence number"),
        ({"timestamp": float("nan")}, "timestamp"),
        ({"name": "bad name"}, "node name"),
        ({"region": "x" * 65}, "region"),
        ({"contact": "line\nbreak"}, "control characters"),
        ({"gpus": [GpuListing("g", 1, 2)]}, "impossible memory"),
        ({"gpus": [GpuListing("g", 1, 1)] * 17}, "at most 16 GPUs"),
        ({"addresses": ["not-an-address"]}, "host:port"),
        # A spammer's listing that outranks every honest one by claiming 1 PiB per GPU.
        (
            {"gpus": [GpuListing("g", 1 << 50, 1 << 50)]},
            "claims 1125899906842624 bytes of memory, over the 512 GiB a GPU may list",
        ),
        ({"gpus": [GpuListing("g", (512 << 30) + 1, 0)]}, "over the 512 GiB"),
        ({"gpus": [GpuListing("g" * 65, 1, 1)]}, "GPU name is 65 characters, over the limit of 64"),
        ({"contact": "c" * 257}, "contact is 257 characters, over the limit of 256"),
        ({"name": "n" * 65}, "node name"),
    ],
)
def test_fields_out_of_bounds_are_refused_on_both_sides(
    changes: dict[str, Any], message: str
) -> None:
    bad = listing(**changes)
    with pytest.raises(ProtocolError, match=message):
        sign_record(_IDENTITY, bad)
    # A hand-signed one (a hostile node) is refused by the reader too.
    body = msgspec.msgpack.encode(bad)
    from gpumesh.protocol.listing import DOMAIN

    with pytest.raises(ProtocolError, match=message):
        open_record(SignedRecord(body, _IDENTITY.sign(DOMAIN + body)))


def test_every_bound_itself_is_accepted() -> None:
    widest = listing(
        name="n" * 63,
        contact="c" * 256,
        gpus=[GpuListing("g" * 64, 512 << 30, 512 << 30)] * 16,
    )
    assert open_record(sign_record(_IDENTITY, widest)) == widest


def test_oversized_record_is_refused_before_decoding() -> None:
    with pytest.raises(ProtocolError, match=f"{MAX_RECORD_BYTES}-byte"):
        open_record(SignedRecord(b"\x00" * (MAX_RECORD_BYTES + 1), b"s" * 64))


def test_signing_with_a_key_the_record_does_not_name_is_a_bug() -> None:
    with pytest.raises(ValueError):
        sign_record(_OTHER, listing())


def test_freshness_window() -> None:
    check_fresh(listing(timestamp=NOW - 599), NOW)
    check_fresh(listing(timestamp=NOW + 299), NOW)
    with pytest.raises(ProtocolError, match="stale record"):
        check_fresh(listing(timestamp=NOW - 601), NOW)
    with pytest.raises(ProtocolError, match="future"):
        check_fresh(listing(timestamp=NOW + 301), NOW)
