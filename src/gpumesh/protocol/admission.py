"""Admitting new QUIC connections, without I/O: the Initial's header, stateless
Retry tokens and packets, and the verdicts a listening endpoint acts on.

A server that makes a connection for every packet shaped like an Initial
holds state for senders that never see its answers (a forged source
address) and for random bytes with the right first byte. A Retry (RFC 9000
§8.1.2) answers an Initial with a token instead: a client that really
receives at its address sends its Initial again, with the token, to the
connection id the Retry gave it, and only then does the server make the
connection. The token is stateless: a MAC, keyed with a secret made when the
endpoint starts, over the client's address, the connection id it chose
first, the one the Retry gave it, and the time it was made; it expires in
seconds.

The clock is passed in; nothing here reads the time of day or touches a socket.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gpumesh.protocol.addresses import Address

__all__ = [
    "MIN_INITIAL_SIZE",
    "QUIC_V1",
    "TOKEN_LIFETIME",
    "Admission",
    "DropReason",
    "InitialHeader",
    "RetryTokens",
    "encode_retry",
    "parse_initial",
]

QUIC_V1 = 0x00000001
MIN_INITIAL_SIZE = 1200
"""A client's Initial travels in a datagram of at least this many bytes (RFC 9000 §14.1)."""
TOKEN_LIFETIME = 10.0
"""Seconds a Retry token stays good: the client echoes it one round trip later, and
may resend its Initial a few times within a dial's timeout."""

_MAX_CID = 20
_MIN_CLIENT_DCID = 8  # RFC 9000 §7.2: a client's first destination id is at least 8 bytes
_TOKEN_MARK = b"R1"
_MAC_SIZE = 16
_STAMP_SIZE = 8
# RFC 9001 §5.8: the fixed key and nonce of the Retry integrity tag, QUIC version 1.
_RETRY_KEY = bytes.fromhex("be0c690b9f66575a1d766b54e368c84e")
_RETRY_NONCE = bytes.fromhex("461599d35d632bf2239825bb")
_retry_aead = AESGCM(_RETRY_KEY)


class Admission(Enum):
    """What to do with an Initial that may open a connection, when it is not dropped."""

    ACCEPT = "accept"
    """Make the connection."""
    RETRY = "retry"
    """Answer with a Retry: no state until the sender proves its address."""


class DropReason(Enum):
    """Why a packet that opens no connection was dropped; the value reads in a summary."""

    NOT_QUIC = "not QUIC"
    STRAY = "for no open connection"
    NOT_INITIAL = "not a QUIC Initial"
    UNDECRYPTABLE = "an Initial that does not decrypt"
    BAD_TOKEN = "a forged or misaddressed token"
    EXPIRED_TOKEN = "an expired token"
    PENALIZED = "from an address that failed the identity proof"
    OVER_RATE = "over their address's rate"
    ADDRESS_BUSY = "too many connections mid-proof from their address"
    BUSY = "too many connections mid-proof"


@dataclass(frozen=True, slots=True)
class InitialHeader:
    """The clear part of a client's QUIC version 1 Initial packet."""

    version: int
    dcid: bytes
    """Destination connection id: chosen by the client, or given by our Retry."""
    scid: bytes
    """Source connection id: where our answers go."""
    token: bytes
    """Empty, or the token of a Retry (or of a NEW_TOKEN frame, which we never send)."""


def parse_initial(packet: bytes) -> InitialHeader | None:
    """The header of a client Initial that may open a connection, or None.

    None for anything else: a short header, another long-header type, another
    version, a datagram under :data:`MIN_INITIAL_SIZE`, ids of the wrong length,
    or a token that runs past the packet.
    """
    # Long header, fixed bit, type Initial (0 in version 1); the low bits are protected.
    if len(packet) < MIN_INITIAL_SIZE or packet[0] & 0xF0 != 0xC0:
        return None
    version = int.from_bytes(packet[1:5], "big")
    if version != QUIC_V1:
        return None
    dcid_length = packet[5]
    if not _MIN_CLIENT_DCID <= dcid_length <= _MAX_CID:
        return None
    offset = 6 + dcid_length
    scid_length = packet[offset]
    if scid_length > _MAX_CID:
        return None
    scid = packet[offset + 1 : offset + 1 + scid_length]
    offset += 1 + scid_length
    token_length, offset = _varint(packet, offset)
    if offset + token_length > len(packet):
        return None
    return InitialHeader(
        version=version,
        dcid=packet[6 : 6 + dcid_length],
        scid=scid,
        token=packet[offset : offset + token_length],
    )


def _varint(data: bytes, offset: int) -> tuple[int, int]:
    """A QUIC variable-length integer at ``offset``: (value, offset after it)."""
    length = 1 << (data[offset] >> 6)
    value = data[offset] & 0x3F
    for byte in data[offset + 1 : offset + length]:
        value = (value << 8) | byte
    return value, offset + length


def encode_retry(
    version: int, dcid: bytes, scid: bytes, original_dcid: bytes, token: bytes, unused: int = 0
) -> bytes:
    """A Retry packet (RFC 9000 §17.2.5) with its integrity tag (RFC 9001 §5.8).

    ``dcid`` is the client's source id, ``scid`` the id it must use from now
    on, ``original_dcid`` the destination id of the Initial answered.
    """
    packet = b"".join(
        (
            bytes([0xF0 | (unused & 0x0F)]),
            version.to_bytes(4, "big"),
            bytes([len(dcid)]),
            dcid,
            bytes([len(scid)]),
            scid,
            token,
        )
    )
    pseudo = bytes([len(original_dcid)]) + original_dcid + packet
    return packet + _retry_aead.encrypt(_RETRY_NONCE, b"", pseudo)


class RetryTokens:
    """Mints and checks Retry tokens; holds nothing per client.

    A token is ``mark || made-at (ms) || len || original dcid || MAC``; the MAC
    also covers the client's address and the connection id the Retry gave
    it, which the client's next Initial is sent to. So a token works only from
    the address it was sent to, only with its own Retry's connection id, and
    only for :data:`TOKEN_LIFETIME` seconds.
    """

    def __init__(
        self,
        secret: bytes,
        *,
        lifetime: float = TOKEN_LIFETIME,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if len(secret) < 16:
            raise ValueError("the Retry secret needs at least 16 bytes")
        self._key = hashlib.sha256(secret).digest()  # blake2s takes a key of at most 32 bytes
        self.lifetime = lifetime
        self._clock = clock

    def mint(self, address: Address, original_dcid: bytes, retry_scid: bytes) -> bytes:
        stamp = int(self._clock() * 1000).to_bytes(_STAMP_SIZE, "big")
        body = _TOKEN_MARK + stamp + bytes([len(original_dcid)]) + original_dcid
        return body + self._mac(body, address, retry_scid)

    def check(self, address: Address, token: bytes, dcid: bytes) -> bytes | DropReason:
        """The original destination id ``token`` vouches for, or why it does not.

        ``dcid`` is the destination id of the Initial that carries the token.
        """
        head = len(_TOKEN_MARK) + _STAMP_SIZE
        if len(token) <= head or not token.startswith(_TOKEN_MARK):
            return DropReason.BAD_TOKEN
        length = token[head]
        body_end = head + 1 + length
        if length > _MAX_CID or len(token) != body_end + _MAC_SIZE:
            return DropReason.BAD_TOKEN
        body, mac = token[:body_end], token[body_end:]
        if not hmac.compare_digest(mac, self._mac(body, address, dcid)):
            return DropReason.BAD_TOKEN
        made = int.from_bytes(token[len(_TOKEN_MARK) : head], "big") / 1000
        age = self._clock() - made
        if not -1.0 <= age <= self.lifetime:
            return DropReason.EXPIRED_TOKEN
        return token[head + 1 : body_end]

    def _mac(self, body: bytes, address: Address, retry_scid: bytes) -> bytes:
        where = f"{address[0]}|{address[1]}".encode()
        mac = hashlib.blake2s(key=self._key, digest_size=_MAC_SIZE)
        for part in (body, bytes([len(retry_scid)]), retry_scid, where):
            mac.update(part)
        return mac.digest()
