"""protocol/peeraddresses and store/peerrecords: which address records a node takes from a peer."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from gpumesh.errors import ProtocolError
from gpumesh.identity.keys import Identity
from gpumesh.protocol.listing import DOMAIN, AddressRecord, Withdrawal, sign_record
from gpumesh.protocol.messages import SignedAddresses
from gpumesh.protocol.peeraddresses import (
    MAX_PEER_RECORD_AGE,
    StaleRecordError,
    claimed_node,
    open_peer_record,
    seq_of,
    sign_own_record,
)
from gpumesh.store.peerrecords import PeerRecords, StoredRecord
from tests.badhints import BAD_HINTS

NOW = 1_800_000_000.0


def test_a_record_signed_by_the_pinned_key_is_taken() -> None:
    carol = Identity.generate()
    signed = sign_own_record(carol, ["127.0.0.1:4000"], "relay.example:7000", NOW)
    record = open_peer_record(signed, carol.public_key, NOW)
    assert record.addresses == ["127.0.0.1:4000"] and record.relay == "relay.example:7000"
    assert claimed_node(signed) == carol.node_id
    assert seq_of(signed.record) == record.seq


def test_sequence_numbers_strictly_increase_within_a_process() -> None:
    carol = Identity.generate()
    first = sign_own_record(carol, [], "", NOW)
    second = sign_own_record(carol, [], "", NOW)  # same clock reading
    assert seq_of(second.record) > seq_of(first.record)


def test_a_record_of_another_node_is_refused_even_when_it_verifies() -> None:
    carol, mallory = Identity.generate(), Identity.generate()
    theirs = sign_own_record(mallory, ["10.0.0.1:1"], "", NOW)
    with pytest.raises(ProtocolError, match="signed by another key"):
        open_peer_record(theirs, carol.public_key, NOW)


def test_a_record_naming_the_pinned_key_but_signed_by_another_is_refused() -> None:
    carol, mallory = Identity.generate(), Identity.generate()
    record = AddressRecord(public_key=carol.public_key, seq=5, timestamp=NOW, addresses=[])
    body = msgspec.msgpack.encode(record)
    forged = SignedAddresses(record=body, signature=mallory.sign(DOMAIN + body))
    with pytest.raises(ProtocolError, match="does not verify"):
        open_peer_record(forged, carol.public_key, NOW)
    altered = SignedAddresses(
        record=body.replace(b"\x05", b"\x06", 1),
        signature=carol.sign(DOMAIN + body),
    )
    with pytest.raises(ProtocolError, match="does not verify"):
        open_peer_record(altered, carol.public_key, NOW)


def test_an_old_or_replayed_or_future_record_is_refused() -> None:
    carol = Identity.generate()
    signed = sign_own_record(carol, [], "", NOW)
    with pytest.raises(StaleRecordError, match="not newer"):
        open_peer_record(signed, carol.public_key, NOW, after_seq=seq_of(signed.record))
    with pytest.raises(ProtocolError, match="days old"):
        open_peer_record(signed, carol.public_key, NOW + MAX_PEER_RECORD_AGE + 1)
    with pytest.raises(ProtocolError, match="in the future"):
        open_peer_record(signed, carol.public_key, NOW - 3600)


def test_a_listing_record_is_not_an_address_record() -> None:
    carol = Identity.generate()
    withdrawal = sign_record(carol, Withdrawal(public_key=carol.public_key, seq=1, timestamp=NOW))
    wrapped = SignedAddresses(record=withdrawal.record, signature=withdrawal.signature)
    with pytest.raises(ProtocolError, match="not an address record"):
        open_peer_record(wrapped, carol.public_key, NOW)
    assert claimed_node(SignedAddresses(record=b"junk", signature=b"s" * 64)) is None
    # A record that decodes but names a key of the wrong size claims no node either.
    short = AddressRecord(public_key=b"short", seq=1, timestamp=NOW, addresses=[])
    wrapped = SignedAddresses(record=msgspec.msgpack.encode(short), signature=b"s" * 64)
    assert claimed_node(wrapped) is None


def test_stored_records_round_trip_and_bad_files_read_as_none(tmp_path: Path) -> None:
    records = PeerRecords(tmp_path)
    carol = Identity.generate()
    node_id = str(carol.node_id)
    assert records.get(node_id) is None
    signed = sign_own_record(carol, ["127.0.0.1:1"], "", NOW)
    stored = StoredRecord(signed.record, signed.signature, True, NOW)
    records.save(node_id, stored)
    assert records.get(node_id) == stored
    assert (tmp_path / "peer-addresses").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "peer-addresses" / node_id).stat().st_mode & 0o777 == 0o600
    (tmp_path / "peer-addresses" / node_id).write_bytes(b"\xc1 not msgpack")
    assert records.get(node_id) is None
    records.forget(node_id)
    records.forget(node_id)  # twice is fine
    assert records.get(node_id) is None
    with pytest.raises(ValueError, match="not a node id"):
        records.get("../etc/passwd")


@pytest.mark.parametrize("hint", BAD_HINTS)
def test_a_record_with_a_bad_address_or_relay_is_refused(hint: str) -> None:
    """A paired peer signs its own record, so it may put anything in it: a bad hint
    refuses the record (its addresses are never stored or handed on)."""
    node = Identity.generate()
    with pytest.raises(ProtocolError, match="address"):
        open_peer_record(sign_own_record(node, [hint], "", NOW), node.public_key, NOW)
    if hint != "192.0.2.1":  # a relay alone is a host: its port defaults
        with pytest.raises(ProtocolError, match="relay"):
            open_peer_record(
                sign_own_record(node, ["192.0.2.1:1"], hint, NOW), node.public_key, NOW
            )
