"""LAN announcements: how paired peers on one network find each other with no server.

A node sends a short UDP datagram to a multicast group (and, where multicast is
filtered, to its peers' last-known addresses). It says nothing to strangers: after
a fixed prefix it carries a flag, the QUIC port it listens on (0: none), a random
nonce and a list of tags. Each tag is a truncated HMAC, under a key only the
announcer and one paired peer hold, of the time window, the nonce, the port and
the flag: a peer recognises its own tag, a stranger sees random bytes that never
repeat. Random tags pad each datagram to a multiple of :data:`TAG_PAD`, so the
count tells only roughly how many peers a node has.

The key of a pair is their X25519 secret (:meth:`Identity.shared_secret`), made
directional (announcer to listener) so one side's tags are never the other's.

A match is only a hint: the listener dials the address through the usual
authenticated dial, which checks the pinned key. What a replay, a stranger or a
flood can cost is bounded here, without I/O: :class:`Listener` checks the rate
of each source and of all sources together before any HMAC, remembers the
nonces of matched datagrams (a replay is dropped), and keeps bounded tables;
:class:`Gate` spaces the dials and answers it leads to.

This module never touches a socket or the clock: time and randomness are passed in.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpumesh.errors import ProtocolError

__all__ = [
    "FLAG_ANSWER",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_TAGS",
    "TAG_PAD",
    "TAG_SIZE",
    "WINDOW",
    "Announcement",
    "Gate",
    "Heard",
    "Listener",
    "RateLimit",
    "announcements",
    "decode",
    "encode",
    "lan_key",
    "tag",
    "window_of",
]

MAGIC = b"gmL\x01"
"""What every announcement starts with: ``gmL`` and the format's version, 1."""
FLAG_ANSWER = 0x01
"""Set on an announcement sent in answer to one heard: it is not answered again."""
_HEADER = struct.Struct("!4sBH8s")
HEADER_SIZE = _HEADER.size
"""The prefix, the flags, the port and the nonce: 15 bytes."""
NONCE_SIZE = 8
TAG_SIZE = 10
"""Bytes of each tag: 80 bits, so a guess matches with odds of 2**-80."""
MAX_TAGS = 32
"""Tags in one datagram; a node with more peers sends several (at most 335 bytes each)."""
TAG_PAD = 8
"""Tags per datagram are padded with random ones to a multiple of this."""
MAX_SIZE = HEADER_SIZE + MAX_TAGS * TAG_SIZE
WINDOW = 60.0
"""Seconds of one time window; a tag of the window before or after this one matches
too, so clocks may differ by about a minute."""
SEEN_KEEP = 3 * WINDOW
"""Seconds a matched nonce is remembered: past them its tags no longer match anyway."""
MAX_SEEN = 4096
"""Nonces remembered at most (only matched ones, so only what paired peers sent)."""
SOURCE_RATE = 5.0
"""Datagrams per second each source address may send before the rest are dropped."""
SOURCE_BURST = 64.0
"""A node with 2,000 peers announces in 63 datagrams at once."""
TOTAL_RATE = 100.0
"""Datagrams per second from all sources together that are checked against the peers."""
TOTAL_BURST = 200.0
MAX_SOURCES = 1024
"""Source addresses whose rate is tracked at once (the least recent are forgotten)."""

_KEY_LABEL = b"gpumesh lan key 1"
_TAG_LABEL = b"gpumesh lan tag 1"


def window_of(now: float) -> int:
    """The time window of the Unix time ``now``."""
    return int(now // WINDOW)


def lan_key(secret: bytes, announcer: bytes, listener: bytes) -> bytes:
    """The key of the tags ``announcer`` (a public key) puts in its announcements for
    ``listener``: from the pair's shared secret, different in each direction."""
    return hmac.digest(secret, _KEY_LABEL + announcer + listener, hashlib.sha256)


def tag(key: bytes, window: int, nonce: bytes, port: int, flags: int) -> bytes:
    """One peer's tag in an announcement of ``window``."""
    message = _TAG_LABEL + struct.pack("!Q8sHB", window, nonce, port, flags)
    return hmac.digest(key, message, hashlib.sha256)[:TAG_SIZE]


@dataclass(frozen=True)
class Announcement:
    """One datagram, decoded."""

    port: int
    """The QUIC port the announcer listens on; 0: it does not (it only listens here)."""
    flags: int
    """:data:`FLAG_ANSWER`, and bits a later version may add (covered by the tags)."""
    nonce: bytes
    tags: tuple[bytes, ...]

    @property
    def answer(self) -> bool:
        """Sent in answer to an announcement: not to be answered."""
        return bool(self.flags & FLAG_ANSWER)


def encode(announcement: Announcement) -> bytes:
    head = _HEADER.pack(MAGIC, announcement.flags, announcement.port, announcement.nonce)
    return head + b"".join(announcement.tags)


def decode(data: bytes) -> Announcement:
    """An announcement from a datagram; ProtocolError when it is not a well-formed one.
    Flags this version does not know are ignored (a later version's)."""
    if len(data) < HEADER_SIZE + TAG_SIZE:
        raise ProtocolError(f"{len(data)} bytes: too short for an announcement")
    if len(data) > MAX_SIZE:
        raise ProtocolError(f"{len(data)} bytes: longer than an announcement may be")
    magic, flags, port, nonce = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError("not a GPUMesh announcement of a known version")
    body = data[HEADER_SIZE:]
    if len(body) % TAG_SIZE:
        raise ProtocolError(f"{len(body)} bytes of tags: not a whole number of tags")
    tags = tuple(body[i : i + TAG_SIZE] for i in range(0, len(body), TAG_SIZE))
    return Announcement(port, flags, nonce, tags)


def announcements(
    keys: Sequence[bytes],
    *,
    port: int,
    answer: bool,
    now: float,
    random: Callable[[int], bytes],
) -> list[bytes]:
    """The datagrams that announce this node to the peers of ``keys`` (each made by
    :func:`lan_key` with this node as announcer): :data:`MAX_TAGS` tags each, padded.
    None without keys: with no peer there is no one to tell."""
    flags = FLAG_ANSWER if answer else 0
    window = window_of(now)
    packets = []
    for start in range(0, len(keys), MAX_TAGS):
        nonce = random(NONCE_SIZE)
        tags = [tag(key, window, nonce, port, flags) for key in keys[start : start + MAX_TAGS]]
        while len(tags) % TAG_PAD:
            tags.append(random(TAG_SIZE))
        packets.append(encode(Announcement(port, flags, nonce, tuple(tags))))
    return packets


class RateLimit:
    """Token buckets by key (``rate`` per second, up to ``burst``), at most ``keys``
    of them: the least recently used is forgotten first."""

    def __init__(self, rate: float, burst: float, keys: int = MAX_SOURCES) -> None:
        self.rate = rate
        self.burst = burst
        self.keys = keys
        self._buckets: OrderedDict[str, tuple[float, float, bool]] = OrderedDict()
        """By key: tokens, when they were counted, whether a refusal was reported since
        the last datagram let through."""

    def __len__(self) -> int:
        return len(self._buckets)

    def allow(self, key: str, now: float) -> tuple[bool, bool]:
        """Whether one more is allowed now; and, for a refusal, whether it is the first
        since the last one allowed (worth a log line; the rest are not)."""
        tokens, at, reported = self._buckets.pop(key, (self.burst, now, False))
        tokens = min(self.burst, tokens + max(0.0, now - at) * self.rate)
        allowed = tokens >= 1.0
        first_refusal = not allowed and not reported
        self._buckets[key] = (tokens - 1.0 if allowed else tokens, now, not allowed)
        while len(self._buckets) > self.keys:
            self._buckets.popitem(last=False)
        return allowed, first_refusal


class Gate:
    """At most once per ``gap`` seconds per key (a peer): a replayed or repeated hint
    costs at most one dial, or one answer, per gap. At most ``keys`` keys."""

    def __init__(self, gap: float, keys: int = MAX_SOURCES) -> None:
        self.gap = gap
        self.keys = keys
        self._last: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last)

    def ready(self, key: str, now: float) -> bool:
        """Whether ``key`` may go now (it is then counted as gone)."""
        last = self._last.get(key)
        if last is not None and 0.0 <= now - last < self.gap:
            return False
        self._last.pop(key, None)
        self._last[key] = now
        while len(self._last) > self.keys:
            self._last.popitem(last=False)
        return True


@dataclass(frozen=True)
class Heard:
    """What one datagram told the listener."""

    peers: tuple[str, ...] = ()
    """The paired peers (ids) whose tag it carries; empty when dropped."""
    port: int = 0
    answer: bool = False
    dropped: str = ""
    """Why it was dropped (``rate-limited``, ``malformed: ...``, ``no paired peer's
    tag``, ``replayed``); empty when it matched."""
    quiet: bool = False
    """A drop not worth a log line (another refusal of a source already reported)."""


class Listener:
    """Matches the announcements heard against the paired peers' keys, within bounds."""

    def __init__(
        self,
        *,
        source_rate: float = SOURCE_RATE,
        source_burst: float = SOURCE_BURST,
        total_rate: float = TOTAL_RATE,
        total_burst: float = TOTAL_BURST,
    ) -> None:
        self._keys: dict[str, bytes] = {}
        self._per_source = RateLimit(source_rate, source_burst)
        self._total = RateLimit(total_rate, total_burst, keys=1)
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def set_peers(self, keys: Mapping[str, bytes]) -> None:
        """The peers to recognise: by peer id, the :func:`lan_key` with that peer as
        announcer and this node as listener."""
        self._keys = dict(keys)

    @property
    def remembered(self) -> int:
        """Nonces remembered now (bounded by :data:`MAX_SEEN`)."""
        return len(self._seen)

    @property
    def sources(self) -> int:
        """Source addresses whose rate is tracked now (bounded by :data:`MAX_SOURCES`)."""
        return len(self._per_source)

    def receive(self, data: bytes, source: str, now: float) -> Heard:
        """What the datagram ``data`` from the address ``source`` says, at Unix time
        ``now``."""
        allowed, first = self._per_source.allow(source, now)
        if not allowed:
            return Heard(dropped="rate-limited", quiet=not first)
        allowed, first = self._total.allow("", now)
        if not allowed:
            return Heard(dropped="rate-limited (all sources)", quiet=not first)
        try:
            announcement = decode(data)
        except ProtocolError as exc:
            return Heard(dropped=f"malformed: {exc.message}")
        matched = tuple(self._matches(announcement, now))
        if not matched:
            return Heard(dropped="no paired peer's tag")
        self._forget(now)
        if announcement.nonce in self._seen:
            return Heard(dropped="replayed")
        self._seen[announcement.nonce] = now + SEEN_KEEP
        while len(self._seen) > MAX_SEEN:
            self._seen.popitem(last=False)
        return Heard(matched, announcement.port, announcement.answer)

    def _matches(self, announcement: Announcement, now: float) -> Iterable[str]:
        tags = set(announcement.tags)
        window = window_of(now)
        for peer_id, key in self._keys.items():
            for w in (window, window - 1, window + 1):
                expected = tag(key, w, announcement.nonce, announcement.port, announcement.flags)
                if expected in tags:
                    yield peer_id
                    break

    def _forget(self, now: float) -> None:
        while self._seen:
            nonce, until = next(iter(self._seen.items()))
            if until > now:
                break
            del self._seen[nonce]
