"""Signed registry records: GPU listings, withdrawals and address records.

A node publishes these to a public registry (``gpumesh-registry``); anyone
may read them back. Each record is signed by the node's identity key, so
neither the registry nor anyone on the way can forge or alter one: a reader
checks every signature itself.

Encoding: a record is msgpack (one tagged struct of the union below) and the
signature covers those exact bytes behind a domain prefix. The bytes travel
as they were signed (base64 in the registry's JSON), so there is no second,
"canonical" form to get wrong: what is verified is what was sent.

Freshness: ``seq`` strictly increases per key and kind (a listing and its
withdrawal share one sequence, address records have their own); a registry
refuses a record whose ``seq`` is not above the last one it accepted, and one
whose ``timestamp`` is too far from its own clock, which bounds how long it
must remember sequence numbers to refuse a replay.

What a listing carries is fixed here: GPU models and memory, idle or busy,
region, the owner's contact text, software version. Never a workload, and no
address unless the owner asks (``addresses`` empty by default).

Pure code: no socket, no clock (``now`` is passed in), no database.
"""

from __future__ import annotations

import math
from typing import Final

import msgspec

from gpumesh.errors import IdentityError, ProtocolError
from gpumesh.identity.hints import check_hint
from gpumesh.identity.keys import (
    PUBLIC_KEY_SIZE,
    Identity,
    NodeId,
    check_node_name,
    node_id_for,
    verify_signature,
)
from gpumesh.protocol.addresses import parse_address

__all__ = [
    "CLOCK_SKEW",
    "MAX_AGE",
    "MAX_RECORD_BYTES",
    "AddressRecord",
    "GpuListing",
    "Listing",
    "Record",
    "SignedRecord",
    "Withdrawal",
    "check_fresh",
    "open_record",
    "record_kind",
    "sign_record",
]

DOMAIN: Final = b"gpumesh-registry-record-v1\x00"
MAX_RECORD_BYTES: Final = 4096
"""Encoded record, before base64: a listing with 16 GPUs and 16 addresses fits."""
MAX_GPUS: Final = 16
MAX_ADDRESSES: Final = 16
MAX_ADDRESS_CHARS: Final = 255
MAX_REGION_CHARS: Final = 64
MAX_CONTACT_CHARS: Final = 256
MAX_GPU_NAME_CHARS: Final = 64
"""Driver model names are about 40 (``NVIDIA RTX 6000 Ada Generation``)."""
MAX_VERSION_CHARS: Final = 32
MAX_MEMORY: Final = 512 << 30
"""Bytes one GPU may claim: above every GPU made (288 GB), far below what would let a
listing outrank every honest one by claiming absurd memory."""
MAX_SEQ: Final = (1 << 63) - 1
"""Fits a signed 64-bit column (PostgreSQL's bigint)."""
MAX_AGE: Final = 600.0
"""A record older than this (by its timestamp) is refused as stale."""
CLOCK_SKEW: Final = 300.0
"""How far in the future a record's timestamp may be."""


class GpuListing(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One GPU of a listing."""

    name: str
    """The model as the driver names it, e.g. ``NVIDIA GeForce RTX 4090``."""
    memory_total: int
    """Bytes of GPU memory."""
    memory_free: int
    """Bytes of it free when the listing was made."""


class _Signed(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What every kind of record starts with."""

    public_key: bytes
    """Raw Ed25519 public key that signs it; the node id derives from it."""
    seq: int
    """Strictly increasing per key (a listing's and its withdrawal's are one sequence)."""
    timestamp: float
    """Unix time the node made it."""

    @property
    def node_id(self) -> NodeId:
        return node_id_for(self.public_key)


class Listing(_Signed, frozen=True, forbid_unknown_fields=True, tag="listing"):
    """A node's public GPU listing: metadata only, it grants nothing."""

    name: str
    """The node's name."""
    gpus: list[GpuListing]
    idle: bool
    """No job runs on the node now."""
    region: str = ""
    contact: str = ""
    """How to reach the owner (free text, e.g. ``matrix:@alice:example.org``)."""
    version: str = ""
    """The node's GPUMesh version."""
    addresses: list[str] = []
    """``host:port`` where the node listens; empty unless the owner asks."""


class Withdrawal(_Signed, frozen=True, forbid_unknown_fields=True, tag="withdrawal"):
    """The node stopped sharing publicly: remove its listing now."""


class AddressRecord(_Signed, frozen=True, forbid_unknown_fields=True, tag="addresses"):
    """Where a node can be dialled now, for peers that paired with it (discovery)."""

    addresses: list[str]
    """``host:port`` where the node listens or was seen."""
    relay: str = ""
    """``host:port`` of the relay it registers with, or empty."""


Record = Listing | Withdrawal | AddressRecord


class SignedRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A record's bytes and the Ed25519 signature over them (base64 in JSON)."""

    record: bytes
    signature: bytes


_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Record] = msgspec.msgpack.Decoder(Record)


def record_kind(record: Record) -> str:
    """The sequence a record belongs to: ``listing`` (with withdrawals) or ``addresses``."""
    return "addresses" if isinstance(record, AddressRecord) else "listing"


def sign_record(identity: Identity, record: Record) -> SignedRecord:
    """Encode ``record`` and sign it with ``identity`` (which must own its key)."""
    if record.public_key != identity.public_key:
        raise ValueError("a record is signed by the key it names")
    check_record(record)
    body = _encoder.encode(record)
    if len(body) > MAX_RECORD_BYTES:
        raise ProtocolError(
            f"this record encodes to {len(body)} bytes, over the {MAX_RECORD_BYTES}-byte limit; "
            "shorten the contact text or list fewer addresses"
        )
    return SignedRecord(record=body, signature=identity.sign(DOMAIN + body))


def open_record(signed: SignedRecord) -> Record:
    """Decode a signed record and check its size, fields and signature.

    Raises :class:`ProtocolError` naming what is wrong; a record returned
    was signed by the key it carries, exactly as it is.
    """
    if len(signed.record) > MAX_RECORD_BYTES:
        raise ProtocolError(f"the record is over the {MAX_RECORD_BYTES}-byte limit")
    try:
        record = _decoder.decode(signed.record)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"the record is malformed ({exc})") from None
    if len(record.public_key) != PUBLIC_KEY_SIZE:
        raise ProtocolError("the record's public key is not a 32-byte Ed25519 key")
    if not verify_signature(record.public_key, signed.signature, DOMAIN + signed.record):
        raise ProtocolError(
            f"the record of node {node_id_for(record.public_key)} does not verify: its "
            "signature is not that node's over these bytes (altered or forged)"
        )
    check_record(record)
    return record


def check_fresh(record: Record, now: float) -> None:
    """Refuse a record whose timestamp is older than :data:`MAX_AGE` or ahead by over
    :data:`CLOCK_SKEW`."""
    if record.timestamp < now - MAX_AGE:
        raise ProtocolError(
            f"stale record: made {now - record.timestamp:.0f}s ago, the registry accepts "
            f"records at most {MAX_AGE:.0f}s old; publish a fresh one (check the clock)"
        )
    if record.timestamp > now + CLOCK_SKEW:
        raise ProtocolError(
            f"record from the future: its timestamp is {record.timestamp - now:.0f}s ahead of "
            "the registry's clock; check this machine's clock"
        )


def check_record(record: Record) -> None:
    """Every field within its bounds; raises :class:`ProtocolError` naming the first that is not."""
    if not 1 <= record.seq <= MAX_SEQ:
        raise ProtocolError(f"the record's sequence number {record.seq} is out of range")
    if not math.isfinite(record.timestamp) or record.timestamp < 0:
        raise ProtocolError("the record's timestamp is not a time")
    if isinstance(record, Listing):
        _check_listing(record)
    elif isinstance(record, AddressRecord):
        _check_addresses(record.addresses)
        _text(record.relay, "relay", MAX_ADDRESS_CHARS)
        if record.relay:
            try:
                check_hint(record.relay, port_optional=True)
            except ValueError as exc:
                raise ProtocolError(f"the record's relay {exc}") from None


def _check_listing(listing: Listing) -> None:
    try:
        check_node_name(listing.name)
    except IdentityError:
        raise ProtocolError(f"the listing's node name {listing.name[:70]!r} is invalid") from None
    _text(listing.region, "region", MAX_REGION_CHARS)
    _text(listing.contact, "contact", MAX_CONTACT_CHARS)
    _text(listing.version, "version", MAX_VERSION_CHARS)
    if len(listing.gpus) > MAX_GPUS:
        raise ProtocolError(
            f"a listing names at most {MAX_GPUS} GPUs; this one names {len(listing.gpus)}"
        )
    for gpu in listing.gpus:
        _text(gpu.name, "GPU name", MAX_GPU_NAME_CHARS)
        if gpu.memory_total > MAX_MEMORY:
            raise ProtocolError(
                f"the listing's GPU {gpu.name[:40]!r} claims {gpu.memory_total} bytes of "
                f"memory, over the {MAX_MEMORY >> 30} GiB a GPU may list"
            )
        if not 0 <= gpu.memory_free <= gpu.memory_total:
            raise ProtocolError(
                f"the listing's GPU {gpu.name[:40]!r} has impossible memory figures"
            )
    _check_addresses(listing.addresses)


def _check_addresses(addresses: list[str]) -> None:
    if len(addresses) > MAX_ADDRESSES:
        raise ProtocolError(f"a record carries at most {MAX_ADDRESSES} addresses")
    for text in addresses:
        _text(text, "address", MAX_ADDRESS_CHARS)
        try:
            parse_address(text)
        except ValueError:
            raise ProtocolError(f"the record's address {text[:60]!r} is not host:port") from None


def _text(text: str, what: str, limit: int) -> None:
    if len(text) > limit:
        raise ProtocolError(
            f"the record's {what} is {len(text)} characters, over the limit of {limit}"
        )
    if not text.isprintable():
        raise ProtocolError(f"the record's {what} contains control characters")
