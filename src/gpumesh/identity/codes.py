"""Pairing codes: one signed, copy-pasteable token that introduces a node.

Layout of the token ``gpm1_<base64url>``; the decoded bytes are::

    u16 body length | body (msgpack SignedOffer) | u32 CRC32 of everything before

The CRC catches a mistyped or truncated code before anything is parsed or any
packet is sent. The signature (Ed25519 by the key inside the offer, over a
domain-separated encoding of the offer) catches tampering: a changed name,
key or address no longer verifies.

The framing (prefix, base64url, length, CRC) is shared with group invites
(``identity/invites.py``) through :func:`encode_token` and :func:`decode_token`,
so every token a user pastes is refused with the same care and wording.
"""

from __future__ import annotations

import base64
import os
import re
import struct
import time
import zlib
from collections.abc import Callable

import msgspec

from gpumesh.errors import ExpiredCodeError, IdentityError, PairingCodeError
from gpumesh.identity.hints import MAX_HINT_CHARS, check_hints
from gpumesh.identity.keys import (
    Identity,
    NodeId,
    check_node_name,
    node_id_for,
    verify_signature,
)

__all__ = [
    "CODE_LIFETIME",
    "CODE_PREFIX",
    "PairingOffer",
    "decode_code",
    "decode_token",
    "encode_token",
    "make_code",
    "verify_code",
]

CODE_PREFIX = "gpm1_"
CODE_LIFETIME = 3600.0
MAX_CODE_CHARS = 4096
MAX_BODY_BYTES = 0xFFFF  # the length field is a u16
MAX_ADDRESSES = 16
MAX_ADDRESS_CHARS = MAX_HINT_CHARS
_DOMAIN = b"gpumesh-pairing-offer-v1\x00"
_CLOCK_SKEW = 300.0
_PAYLOAD_RE = re.compile(r"[A-Za-z0-9_-]*")


class PairingOffer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a pairing code says about its node."""

    name: str
    """The node's name, as its owner chose it."""
    public_key: bytes
    """Raw Ed25519 public key; the node id derives from it."""
    addresses: list[str]
    """``host:port`` hints where the node listens."""
    relay: str
    """``host:port`` of the relay the node registers with, or empty."""
    expires: float
    """Unix time after which the code is refused."""
    nonce: bytes
    """16 random bytes so two codes of one node never repeat."""

    @property
    def node_id(self) -> NodeId:
        return node_id_for(self.public_key)


class _SignedOffer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    offer: bytes
    signature: bytes


_offer_encoder = msgspec.msgpack.Encoder()
_offer_decoder = msgspec.msgpack.Decoder(PairingOffer)
_signed_decoder = msgspec.msgpack.Decoder(_SignedOffer)


def make_code(
    identity: Identity,
    name: str,
    addresses: list[str],
    relay: str = "",
    *,
    clock: Callable[[], float] = time.time,
    lifetime: float = CODE_LIFETIME,
) -> str:
    """A fresh pairing code for this node, valid for ``lifetime`` seconds."""
    offer = PairingOffer(
        name=name,
        public_key=identity.public_key,
        addresses=addresses[:MAX_ADDRESSES],
        relay=relay,
        expires=clock() + lifetime,
        nonce=os.urandom(16),
    )
    offer_bytes = _offer_encoder.encode(offer)
    signed = _SignedOffer(offer=offer_bytes, signature=identity.sign(_DOMAIN + offer_bytes))
    return encode_token(CODE_PREFIX, _offer_encoder.encode(signed))


def encode_token(prefix: str, body: bytes) -> str:
    """``prefix`` + base64url(u16 body length | body | u32 CRC32), without padding."""
    if len(body) > MAX_BODY_BYTES:
        raise ValueError(f"a token body holds at most {MAX_BODY_BYTES} bytes, got {len(body)}")
    raw = struct.pack("!H", len(body)) + body
    raw += struct.pack("!I", zlib.crc32(raw))
    return prefix + base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def decode_token(
    prefix: str,
    code: str,
    noun: str,
    *,
    not_prefixed: str,
    max_chars: int = MAX_CODE_CHARS,
) -> bytes:
    """The body of a token made by :func:`encode_token`, after its length and CRC checks.

    ``noun`` names the token in messages ("pairing code"); ``not_prefixed`` is
    the whole message for text that does not start with ``prefix``. Whitespace
    anywhere is ignored: chat apps wrap long tokens.
    """
    text = "".join(code.split())
    if not text.startswith(prefix):
        raise PairingCodeError(not_prefixed)
    if len(text) > max_chars:
        raise PairingCodeError(f"that {noun} is too long to be genuine")
    payload = text[len(prefix) :]
    if not _PAYLOAD_RE.fullmatch(payload):
        raise PairingCodeError(
            f"that {noun} contains characters that do not belong in a code; copy it again in full"
        )
    truncated = f"that {noun} is truncated; copy it again in full"
    if len(payload) % 4 == 1:  # no base64 text has this length: it was cut
        raise PairingCodeError(truncated)
    raw = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
    if len(raw) < 6:
        raise PairingCodeError(truncated)
    (body_len,) = struct.unpack("!H", raw[:2])
    if len(raw) < 2 + body_len + 4:
        raise PairingCodeError(truncated)
    if len(raw) > 2 + body_len + 4:
        raise PairingCodeError(f"that {noun} has extra characters; copy it again exactly")
    (crc,) = struct.unpack("!I", raw[-4:])
    if zlib.crc32(raw[:-4]) != crc:
        raise PairingCodeError(
            f"that {noun} has a bad checksum (mistyped or cut); copy it again exactly"
        )
    return raw[2:-4]


def decode_code(code: str) -> tuple[PairingOffer, bytes, bytes]:
    """Parse a code and check its CRC; returns (offer, offer bytes, signature).

    Does not check the signature or expiry: see :func:`verify_code`.
    """
    body = decode_token(
        CODE_PREFIX,
        code,
        "pairing code",
        not_prefixed=(
            "that is not a GPUMesh pairing code (codes start with "
            f"{CODE_PREFIX!r}); copy the whole output of `gpumesh pair-code`"
        ),
    )
    try:
        signed = _signed_decoder.decode(body)
        offer = _offer_decoder.decode(signed.offer)
    except msgspec.DecodeError as exc:
        raise PairingCodeError(f"that pairing code is malformed ({exc})") from None
    return offer, signed.offer, signed.signature


def verify_code(code: str, *, clock: Callable[[], float] = time.time) -> PairingOffer:
    """Decode a code and check its signature, fields and expiry."""
    offer, offer_bytes, signature = decode_code(code)
    if not verify_signature(offer.public_key, signature, _DOMAIN + offer_bytes):
        raise PairingCodeError(
            "that pairing code's signature does not verify: it was altered after it was "
            "made; ask the peer for a fresh `gpumesh pair-code`"
        )
    _check_fields(offer)
    now = clock()
    if offer.expires < now:
        minutes = (now - offer.expires) / 60
        raise ExpiredCodeError(
            f"that pairing code expired {minutes:.0f} min ago (codes last 1 hour); "
            "ask the peer for a fresh `gpumesh pair-code`"
        )
    # Written so that NaN (which compares false both ways) is refused too: a code
    # without a real expiry would otherwise never expire.
    if not offer.expires <= now + CODE_LIFETIME + _CLOCK_SKEW:
        raise PairingCodeError(
            "that pairing code claims to be valid for more than an hour; check both "
            "machines' clocks, then ask for a fresh code"
        )
    return offer


def _check_fields(offer: PairingOffer) -> None:
    try:
        check_node_name(offer.name)
    except IdentityError:
        raise PairingCodeError("that pairing code carries an invalid node name") from None
    if len(offer.addresses) > MAX_ADDRESSES:
        raise PairingCodeError("that pairing code carries invalid addresses")
    if len(offer.nonce) != 16:
        raise PairingCodeError("that pairing code is malformed")
    try:
        check_hints(offer.addresses, offer.relay)
    except ValueError as exc:
        field, detail = exc.args
        raise PairingCodeError(
            f"that pairing code carries a bad {field}: {detail}; "
            "ask the peer for a fresh `gpumesh pair-code`"
        ) from None
