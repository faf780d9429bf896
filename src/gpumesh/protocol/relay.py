"""The relay wire format: what nodes and ``gpumesh-relay`` say over UDP.

Relay packets share a node's UDP socket with QUIC (the relay must see the
same NAT mapping that peers will punch through). They are told apart by the
first byte: every QUIC v1 packet has the fixed bit ``0x40`` set, every packet
here starts with a type byte below ``0x40``, then ``b"GM"`` and the wire
version. Anything else is not ours and is dropped.

::

    node                         relay                          peer (serving)
    Hello ---------------------->                                   (no state kept)
          <---------------------- Challenge(nonce = HMAC(secret, addr, minute), observed,
                                            probe_port: a second port that answers a Hello too)
    Register(key, nonce, sig, token proof, serving) -->
          <---------------------- Registered(observed, limits) | Refused(code)
    Connect(peer key, request) -->
                                  Incoming(session, key, observed, candidates, secret) -->
                                 <-- Accept(session, candidates) | Decline(session)
          <---------------------- Connected(request, session, observed, candidates, secret)
    Data(session, QUIC datagram) <------------------------------> Data(session, ...)
    Close(session, code) <------------------------------------->
    KeepAlive(seq, padding) ---->  <- KeepAliveAck(seq, registered, observed)

    node <------------------------- Probe(session, tx, mac) --------------> peer
          (sent straight to each other's candidates: UDP hole punching)

``Data`` is binary (type, magic, version, u64 session, then the QUIC
datagram) so forwarding costs one slice; every other packet is a msgpack
struct with bounded fields. The relay never sees inside a ``Data`` payload:
it is an encrypted QUIC packet between the two nodes.

No answer to an address that has not registered is larger than the packet
it answers (a spoofed source must not turn the relay into an amplifier):
``Hello`` and ``KeepAlive`` are padded by the node, and a refusal to such an
address carries its code alone.

Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Annotated, ClassVar, get_args

import msgspec

from gpumesh.errors import ProtocolError

__all__ = [
    "DATA_HEADER",
    "DEFAULT_RELAY_PORT",
    "HELLO_MIN_SIZE",
    "KEEPALIVE_MIN_SIZE",
    "MAX_PACKET",
    "REFUSALS",
    "REFUSAL_ADVICE",
    "Accept",
    "Challenge",
    "Close",
    "Connect",
    "Connected",
    "Decline",
    "Hello",
    "Incoming",
    "KeepAlive",
    "KeepAliveAck",
    "Probe",
    "ReachProbe",
    "ReachTest",
    "Refused",
    "Register",
    "Registered",
    "RelayMessage",
    "challenge_nonce",
    "decode_data",
    "decode_packet",
    "encode_data",
    "encode_packet",
    "hello_packet",
    "is_data",
    "is_relay_packet",
    "keepalive_packet",
    "probe_mac",
    "register_payload",
    "token_proof",
]

DEFAULT_RELAY_PORT = 4799
WIRE_VERSION = 1
MAGIC = b"GM"
MAX_PACKET = 1500
"""Largest packet either side accepts (a QUIC datagram plus the Data header)."""
MAX_CANDIDATES = 8
REGISTER_DOMAIN = b"gpumesh-relay-register-v1\0"
PROBE_DOMAIN = b"gpumesh-punch-probe-v1\0"

# The type byte of Data (binary, no struct); every other packet's is its class's TYPE.
T_DATA = 0x0B

_DATA = struct.Struct("!B2sBQ")
DATA_HEADER = _DATA.size
"""Bytes a relayed QUIC datagram grows by (12)."""

REFUSALS: dict[str, str] = {
    "malformed": "the relay could not read the packet",
    "version": "the relay speaks another wire version",
    "bad-nonce": "the registration answered a stale or foreign challenge",
    "bad-signature": "the registration signature does not match the key",
    "not-allowed": "this node is not on the relay's allowlist (or its token is wrong)",
    "too-many-registrations": "the relay has no room for more nodes",
    "too-many-per-ip": "too many nodes registered from this IP address",
    "not-registered": "this address is not registered with the relay",
    "unknown-peer": "the peer is not registered with the relay",
    "peer-declined": "the peer declined the relayed connection",
    "too-many-sessions": "this node has too many relayed sessions open",
    "too-many-initiated": "this node has opened too many relayed sessions at once",
    "too-many-to-peer": "this node has too many relayed sessions open to that peer",
    "peer-too-many-sessions": "the peer has too many relayed sessions open; try again later",
    "no-session": "the relayed session does not exist (it ended, or the relay restarted)",
    "byte-cap": "the relayed session reached the relay's byte cap",
    "time-cap": "the relayed session reached the relay's time cap",
    "idle": "the relayed session was idle too long",
    "closed": "the other end closed the relayed session",
    "shutting-down": "the relay is shutting down",
    "relay-full": "the relay has as many relayed sessions open as it allows; try again later",
    "pair-not-allowed": "the relaying peer relays only between peers it has paired and allowed",
}
"""Every refusal code the relay may send, with its meaning for people."""
REFUSAL_ADVICE: dict[str, str] = {
    "unknown-peer": "is `gpumesh share` running there?",
    "pair-not-allowed": "its owner may `gpumesh allow` both ends there",
    "relay-full": "its owner may raise relay_for_peers_sessions",
}
"""What to do about a refusal, where the meaning alone does not say it."""

Key = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
Nonce = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
Secret = Annotated[bytes, msgspec.Meta(min_length=16, max_length=32)]
Signature = Annotated[bytes, msgspec.Meta(min_length=64, max_length=64)]
Mac = Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
AddressText = Annotated[str, msgspec.Meta(max_length=64)]
Candidates = Annotated[list[AddressText], msgspec.Meta(max_length=MAX_CANDIDATES)]
RefusalCode = Annotated[str, msgspec.Meta(max_length=32)]
Text = Annotated[str, msgspec.Meta(max_length=256)]
U16 = Annotated[int, msgspec.Meta(ge=0, lt=2**16)]
U32 = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
U64 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]


class _Packet(msgspec.Struct, frozen=True, array_like=True):
    TYPE: ClassVar[int]
    """The packet's first byte: below 0x40, so no QUIC v1 packet can look like one."""


HELLO_MIN_SIZE = 96
"""A Hello is padded to this size so a spoofed one cannot amplify through the relay."""


class Hello(_Packet, frozen=True):
    """Node -> relay: please send a challenge (the relay keeps no state)."""

    TYPE = 0x01
    padding: Annotated[bytes, msgspec.Meta(max_length=MAX_PACKET)] = b""
    """Zeros making the packet at least :data:`HELLO_MIN_SIZE` bytes (up to
    :data:`MAX_PACKET`: ``gpumesh netcheck`` finds the path MTU with larger ones)."""


class Challenge(_Packet, frozen=True):
    """Relay -> node: sign ``nonce``; ``observed`` is the node's address as the relay sees it."""

    TYPE = 0x02
    nonce: Nonce
    observed: AddressText
    probe_port: U16 = 0
    """The relay's second UDP port, which answers a padded Hello too: a node that
    is seen from another address there is behind a NAT that maps by destination.
    0 from a relay without it."""


class Register(_Packet, frozen=True):
    """Node -> relay: prove the key; ``serving`` nodes receive incoming sessions."""

    TYPE = 0x03
    public_key: Key
    nonce: Nonce
    signature: Signature
    """Ed25519 over :func:`register_payload`."""
    token_proof: bytes
    """:func:`token_proof` of the relay's shared token, or empty."""
    serving: bool
    """True for `gpumesh share`; a short-lived dialer registers with False."""


class Registered(_Packet, frozen=True):
    """Relay -> node: the registration is accepted."""

    TYPE = 0x04
    observed: AddressText
    keepalive: NonNegative
    """Seconds between the node's keep-alives (the relay drops silent nodes)."""
    session_bytes: U64
    """Cap on bytes relayed per session (0: none)."""
    session_seconds: NonNegative
    """Cap on a session's lifetime (0: none)."""


class Refused(_Packet, frozen=True):
    """Relay -> node: a named refusal (a key of :data:`REFUSALS`)."""

    TYPE = 0x05
    code: RefusalCode
    message: Text
    """For people; empty when the relay sent the code alone (to an address that has not
    registered, so the answer stays small): its meaning is then ``REFUSALS[code]``."""
    session: U64 = 0
    """The session or Connect request this ends, or 0."""


class Connect(_Packet, frozen=True):
    """Node -> relay: I want to talk to ``peer``; here is where I might be reached."""

    TYPE = 0x06
    request: U32
    peer: Key
    candidates: Candidates


class Incoming(_Packet, frozen=True):
    """Relay -> serving node: ``peer`` wants to talk (answer Accept or Decline)."""

    TYPE = 0x07
    session: U64
    peer: Key
    observed: AddressText
    candidates: Candidates
    secret: Secret
    """Shared by both ends of the session: keys the punching probes."""


class Accept(_Packet, frozen=True):
    """Serving node -> relay: start forwarding."""

    TYPE = 0x08
    session: U64
    candidates: Candidates


class Decline(_Packet, frozen=True):
    """Serving node -> relay: no (an unknown or denied peer)."""

    TYPE = 0x09
    session: U64


class Connected(_Packet, frozen=True):
    """Relay -> requesting node: the session is open."""

    TYPE = 0x0A
    request: U32
    session: U64
    observed: AddressText
    """The peer's address as the relay sees it."""
    candidates: Candidates
    secret: Secret


class Close(_Packet, frozen=True):
    """Either way: the session is over (``code`` from :data:`REFUSALS`, or ``closed``)."""

    TYPE = 0x0C
    session: U64
    code: RefusalCode
    message: Text


KEEPALIVE_MIN_SIZE = 80
"""A KeepAlive is padded to this size: the relay answers an unregistered address only
when its answer is no larger (any KeepAliveAck, its address at most 64 characters, fits)."""


class KeepAlive(_Packet, frozen=True):
    """Node -> relay: still here (also refreshes the NAT mapping)."""

    TYPE = 0x0D
    seq: U32
    padding: Annotated[bytes, msgspec.Meta(max_length=256)] = b""
    """Zeros making the packet :data:`KEEPALIVE_MIN_SIZE` bytes (see :func:`keepalive_packet`)."""


class KeepAliveAck(_Packet, frozen=True):
    """Relay -> node: ``registered`` False means register again (the relay restarted)."""

    TYPE = 0x0E
    seq: U32
    registered: bool
    observed: AddressText


class Probe(_Packet, frozen=True):
    """Node -> node, straight to a candidate address: a hole-punching probe."""

    TYPE = 0x0F
    session: U64
    tx: U64
    reply: bool
    """False for a probe, True for the answer to probe ``tx``."""
    mac: Mac
    """:func:`probe_mac` with the session secret: only the two ends can make one."""


class ReachTest(_Packet, frozen=True):
    """Node -> relay: send me a ReachProbe from another port (can strangers reach me?)."""

    TYPE = 0x10
    seq: U32


class ReachProbe(_Packet, frozen=True):
    """Relay (from a second port) -> node: arrives only if unsolicited traffic gets in."""

    TYPE = 0x11
    seq: U32


RelayMessage = (
    Hello
    | Challenge
    | Register
    | Registered
    | Refused
    | Connect
    | Incoming
    | Accept
    | Decline
    | Connected
    | Close
    | KeepAlive
    | KeepAliveAck
    | Probe
    | ReachTest
    | ReachProbe
)

_DECODERS: dict[int, msgspec.msgpack.Decoder[_Packet]] = {
    cls.TYPE: msgspec.msgpack.Decoder(cls) for cls in get_args(RelayMessage)
}
_ENCODER = msgspec.msgpack.Encoder()


def is_relay_packet(data: bytes | memoryview) -> bool:
    """True when ``data`` is one of ours rather than a QUIC packet."""
    return len(data) >= 4 and data[0] < 0x40 and data[1:3] == MAGIC


def encode_packet(message: RelayMessage) -> bytes:
    header = bytes((message.TYPE,)) + MAGIC + bytes((WIRE_VERSION,))
    return header + _ENCODER.encode(message)


def hello_packet() -> bytes:
    """A Hello padded to :data:`HELLO_MIN_SIZE` bytes."""
    bare = len(encode_packet(Hello()))
    return encode_packet(Hello(padding=bytes(HELLO_MIN_SIZE - bare + 2)))


def keepalive_packet(seq: int) -> bytes:
    """A KeepAlive padded to :data:`KEEPALIVE_MIN_SIZE` bytes."""
    bare = len(encode_packet(KeepAlive(seq=seq)))  # the padding's own header included
    return encode_packet(KeepAlive(seq=seq, padding=bytes(KEEPALIVE_MIN_SIZE - bare)))


def decode_packet(data: bytes | memoryview) -> RelayMessage:
    """Decode any packet but ``Data`` (see :func:`decode_data`); raise ProtocolError if bad."""
    if len(data) > MAX_PACKET or not is_relay_packet(data):
        raise ProtocolError("not a relay packet")
    if data[3] != WIRE_VERSION:
        raise ProtocolError(f"relay wire version {data[3]} is not {WIRE_VERSION}")
    decoder = _DECODERS.get(data[0])
    if decoder is None:
        raise ProtocolError(f"unknown relay packet type {data[0]:#x}")
    try:
        message: RelayMessage = decoder.decode(data[4:])  # type: ignore[assignment]
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed relay packet: {exc}") from None
    except RecursionError:  # arrays nested past what the decoder walks
        raise ProtocolError("malformed relay packet: nested too deeply") from None
    return message


def is_data(data: bytes | memoryview) -> bool:
    return len(data) >= DATA_HEADER and data[0] == T_DATA and data[1:3] == MAGIC


def encode_data(session: int, datagram: bytes | memoryview) -> bytes:
    return _DATA.pack(T_DATA, MAGIC, WIRE_VERSION, session) + bytes(datagram)


def decode_data(data: bytes | memoryview) -> tuple[int, bytes]:
    """``(session, QUIC datagram)`` of a Data packet."""
    if len(data) > MAX_PACKET or not is_data(data):
        raise ProtocolError("not a relay data packet")
    _, _, version, session = _DATA.unpack_from(data)
    if version != WIRE_VERSION:
        raise ProtocolError(f"relay wire version {version} is not {WIRE_VERSION}")
    return session, bytes(data[DATA_HEADER:])


def register_payload(nonce: bytes, public_key: bytes, serving: bool) -> bytes:
    """What a registering node signs: domain, challenge, its key and its role."""
    return REGISTER_DOMAIN + nonce + public_key + (b"\x01" if serving else b"\x00")


def token_proof(token: str, nonce: bytes) -> bytes:
    """Proof of the relay's shared token without sending it: HMAC-SHA256(token, nonce)."""
    if not token:
        return b""
    return hmac.new(token.encode(), nonce, hashlib.sha256).digest()


def challenge_nonce(secret: bytes, observed: str, epoch: int) -> bytes:
    """A stateless challenge: HMAC of the source address and a time bucket."""
    message = observed.encode() + b"\0" + epoch.to_bytes(8, "big")
    return hmac.new(secret, message, hashlib.sha256).digest()


def probe_mac(secret: bytes, session: int, tx: int, reply: bool) -> bytes:
    message = PROBE_DOMAIN + struct.pack("!QQ?", session, tx, reply)
    return hmac.new(secret, message, hashlib.sha256).digest()[:16]
