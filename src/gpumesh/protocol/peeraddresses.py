"""Address records exchanged between paired peers (``AddressQuery``/``AddressAnswer``).

The records are the registry's (:class:`~gpumesh.protocol.listing.AddressRecord`,
signed by the node's key); what differs is who may see them and how long
they count:

- a record is taken only when it verifies against the key *this* node pinned
  for the node it names (at pairing), never a key the sender supplies;
- its sequence number must be above the last one taken for that node, so a
  peer cannot hand back an old address as new;
- it may be up to :data:`MAX_PEER_RECORD_AGE` old: a node that has not moved
  need not re-announce itself to every peer every few minutes.

Pure code: no socket, no store; ``now`` is passed in.
"""

from __future__ import annotations

import time
from typing import Final

import msgspec

from gpumesh.errors import IdentityError, ProtocolError, StaleRecordError
from gpumesh.identity.keys import Identity, NodeId, node_id_for
from gpumesh.protocol.listing import (
    CLOCK_SKEW,
    MAX_ADDRESSES,
    AddressRecord,
    SignedRecord,
    open_record,
    sign_record,
)
from gpumesh.protocol.messages import SignedAddresses

__all__ = [
    "MAX_PEER_RECORD_AGE",
    "StaleRecordError",
    "claimed_node",
    "open_peer_record",
    "seq_of",
    "sign_own_record",
]

MAX_PEER_RECORD_AGE: Final = 7 * 24 * 3600.0
"""Oldest record a peer may hand on (by its timestamp)."""

_seq_floor = [0]
"""The last ``seq`` this process signed (one item, so it can be raised in place)."""


def sign_own_record(
    identity: Identity, addresses: list[str], relay: str, now: float | None = None
) -> SignedAddresses:
    """This node's current address record, signed; its ``seq`` is microseconds,
    so separate processes of one node need no shared counter."""
    now = time.time() if now is None else now
    seq = max(int(now * 1_000_000), _seq_floor[0] + 1)
    _seq_floor[0] = seq
    record = AddressRecord(
        public_key=identity.public_key,
        seq=seq,
        timestamp=now,
        addresses=addresses[:MAX_ADDRESSES],
        relay=relay,
    )
    signed = sign_record(identity, record)
    return SignedAddresses(record=signed.record, signature=signed.signature)


def claimed_node(signed: SignedAddresses) -> NodeId | None:
    """The node a record says it is of, before anything is verified (to say which
    peer a refused record was about); None when it does not even decode."""
    try:
        record = msgspec.msgpack.decode(signed.record, type=AddressRecord)
        return node_id_for(record.public_key)
    except (msgspec.DecodeError, ValueError, IdentityError):  # a key of the wrong size too
        return None


def open_peer_record(
    signed: SignedAddresses, pinned_key: bytes, now: float, *, after_seq: int = 0
) -> AddressRecord:
    """The record, when it is an address record signed by ``pinned_key``, not too
    old, and newer than ``after_seq``; else :class:`ProtocolError` saying why."""
    record = open_record(SignedRecord(record=signed.record, signature=signed.signature))
    if not isinstance(record, AddressRecord):
        raise ProtocolError("that record is not an address record")
    if record.public_key != pinned_key:
        raise ProtocolError(
            f"the record is signed by another key (node {record.node_id}), not the one paired with"
        )
    if record.timestamp < now - MAX_PEER_RECORD_AGE:
        raise ProtocolError(
            f"the record is {(now - record.timestamp) / 86400:.0f} days old, over the "
            f"{MAX_PEER_RECORD_AGE / 86400:.0f}-day limit"
        )
    if record.timestamp > now + CLOCK_SKEW:
        raise ProtocolError("the record's timestamp is in the future (check the clocks)")
    if record.seq <= after_seq:
        raise StaleRecordError("the record is not newer than the one already stored")
    return record


def seq_of(signed: bytes) -> int:
    """The ``seq`` of stored record bytes (already verified once); 0 when unreadable."""
    try:
        return msgspec.msgpack.decode(signed, type=AddressRecord).seq
    except (msgspec.DecodeError, ValueError):
        return 0
