"""Forward error correction for the datagrams of one QUIC connection (sans I/O).

QUIC's congestion control reads every lost packet as congestion, so on a long
link with random loss its window never grows. This codec hides such loss from
it: the sender groups its datagrams into groups of up to :data:`GROUP_SIZE` and
sends two parity datagrams behind each group (``P``, the XOR of the group, and
``Q``, a Reed-Solomon sum over GF(256) as in RAID-6), so the receiver rebuilds
any one or two datagrams a group lost, byte for byte, before QUIC sees them
missing. Small groups get less (:func:`parities_for`): one parity for a group
of one or two, none for a lone acknowledgement.

Framing (every frame's first byte has QUIC's fixed bit ``0x40`` clear, so no
frame can be taken for a QUIC packet, and differs from the relay's type bytes)::

    data:   0x3C | group (u32) | index (u8)          | QUIC datagram         | tag (16)
    parity: 0x3D | group (u32) | which<<6 | k (u8)    | parity over the group | tag (16)

Frames are authenticated (:class:`FecKeys`, :class:`Sealer`): they carry no
connection id and are routed by source address only, so without a tag anyone who
can send with the peer's address could fill a group's slots ahead of the real
frames (each real one then dropped as a duplicate) and stall the link. The tag is
AES-128-GCM's over the frame with nothing encrypted (GMAC), under a key of each
direction derived from the QUIC session's secret, with a nonce made of the group's
sequence number (64 bits, never reused by a sender) and the frame's header bytes.
The group field is not that sequence number but its image under a keyed 32-bit
permutation, so one seen frame does not tell the next group's id. The previous
framing (``0x3A``/``0x3B``, no tag, group ids counting up) is no longer read:
peers negotiate the tagged one (``fec_mac`` in the handshake messages).

A group's symbols are ``length (u16) | datagram``, zero-padded to the longest of
the group; parity covers them, so a rebuilt datagram gets its length back. A
group that is not full is closed :data:`FLUSH_DELAY` after its first datagram
(the I/O layer asks :meth:`Encoder.flush_at` and calls :meth:`Encoder.poll`), so
interactive traffic waits for nothing: data frames leave at once.

The receiver (:class:`Decoder`) passes every data frame up at once, except that
it never lets QUIC see a gap it could still repair: QUIC declares a packet lost
once three later ones are acknowledged, so while a group misses a datagram the
datagrams that follow it are held (at most :data:`HOLD_TIME`, at most
:data:`MAX_HELD` of them) until the group is repaired or given up, then
released in order; what parity rebuilds for a later group meanwhile waits in its
place among them. Memory is bounded: at most :data:`MAX_GROUPS` open groups.
Hostile or broken frames are dropped and counted, never raised: a frame whose tag
does not verify changes nothing but a counter, and costs one permutation inverse (a
random id is refused there: its sequence number lands far from the sender's) and one
GMAC at most.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

if TYPE_CHECKING:  # numpy loads with the first encoder or decoder, not with QUIC
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "DATA",
    "FLUSH_DELAY",
    "GROUP_SIZE",
    "HOLD_TIME",
    "MAX_GROUPS",
    "MAX_HELD",
    "MAX_PAYLOAD",
    "OVERHEAD",
    "PARITY",
    "SMALL",
    "TAG",
    "Decoder",
    "Encoder",
    "FecCounters",
    "FecKeys",
    "Sealer",
    "parities_for",
]

DATA = 0x3C
PARITY = 0x3D
TAG = 16
"""Bytes of the authentication tag that ends every frame."""
GROUP_SIZE = 16
"""Data datagrams per group (when traffic fills it before :data:`FLUSH_DELAY`)."""
MAX_K = 63
"""Most data datagrams a group may have (the parity header's six bits)."""
PARITIES = 2
"""Parity datagrams per group: P and Q."""
FLUSH_DELAY = 0.01
"""Seconds after its first datagram that a group that is not full is closed."""
HOLD_TIME = 0.05
"""Seconds the receiver holds datagrams behind a gap before it gives the gap up."""
MAX_HELD = 256
MAX_GROUPS = 64
"""Open groups a decoder keeps per peer (the oldest go first)."""
MAX_STORED = 2 * 1024 * 1024
"""Bytes of open groups a decoder keeps per peer (the oldest groups go first)."""
SMALL = 80
"""Datagrams this short carry acknowledgements or pings (a QUIC short header, an ACK
frame and the tag): a group of one such datagram gets no parity (see
:func:`parities_for`)."""
MAX_PAYLOAD = 1500
"""Largest datagram the codec carries (larger ones are sent and taken as they are)."""
_SYMBOL = MAX_PAYLOAD + 2
_DATA_HEADER = struct.Struct("!BIB")
_PARITY_HEADER = struct.Struct("!BIB")
OVERHEAD = _DATA_HEADER.size + TAG
"""Bytes a data frame adds to its datagram (a parity frame adds as many, plus 2)."""
_SMALLEST = _DATA_HEADER.size + 1 + TAG
"""The shortest frame there is (a data frame of a one-byte datagram)."""
_ID_ROUNDS = 4
"""Feistel rounds of the group-id permutation (see :class:`Sealer`): four rounds of
pseudo-random functions make a strong pseudo-random permutation (Luby-Rackoff). A
32-bit domain leaves any permutation a thin margin: the tag, not the id, is what
stops forgeries; the id only keeps an observer from naming the next group."""
_AHEAD = 1 << 16
"""Groups a frame's sequence number may be ahead of the highest authentic one so
far: farther is refused before its tag is checked (a sender that far ahead had a
million datagrams lost in a row, which no QUIC connection survives)."""
_IDS_CACHED = 256
"""Group ids whose sequence number a decoder keeps (authentic frames' only)."""
_RECENT = 4096
"""Finished group ids remembered, so late parity does not reopen them; a frame of a
group further behind the highest authentic one is refused before its tag is checked
(QUIC took its datagrams for lost long ago, and a replay of it must not open a group
that pushes real ones out)."""

# --- GF(256) with the RAID-6 polynomial x^8 + x^4 + x^3 + x^2 + 1 -------------------


def _gf_tables() -> tuple[list[int], list[int]]:
    exp = [0] * 512
    log = [0] * 256
    x = 1
    for i in range(255):
        exp[i] = x
        log[x] = i
        x <<= 1
        if x & 0x100:
            x ^= 0x11D
    for i in range(255, 512):
        exp[i] = exp[i - 255]
    return exp, log


_EXP, _LOG = _gf_tables()


def _inv(a: int) -> int:
    return _EXP[255 - _LOG[a]]


@functools.cache
def _mul_table() -> npt.NDArray[np.uint8]:
    """``_mul_table()[c][v]`` = c·v in GF(256): one lookup multiplies a whole buffer."""
    import numpy as np

    exp = np.array(_EXP, dtype=np.intp)
    log = np.array(_LOG, dtype=np.intp)
    table: npt.NDArray[np.uint8] = exp[log[:, None] + log[None, :]].astype(np.uint8)
    table[0, :] = 0
    table[:, 0] = 0
    return table


def _weighted_sum(symbols: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """Q = sum of g^i · symbol i (g = 2), by Horner's rule from the last row up:
    one table lookup and one XOR per row."""
    times_g = _mul_table()[2]
    q: npt.NDArray[np.uint8] = symbols[-1].copy()
    for row in symbols[-2::-1]:
        q = times_g.take(q)
        q ^= row
    return q


def _scale(coefficient: int, symbol: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    result: npt.NDArray[np.uint8] = _mul_table()[coefficient][symbol]
    return result


def _symbol(datagram: bytes) -> npt.NDArray[np.uint8]:
    import numpy as np

    return np.frombuffer(struct.pack("!H", len(datagram)) + datagram, dtype=np.uint8)


# --- authentication ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FecKeys:
    """The keys of one direction of one link: its frames' MAC key and its group-id
    permutation key. Each end derives both directions' from the secret the QUIC
    session gave (:meth:`derive`), so a frame reflected back at its sender fails."""

    mac: bytes
    """AES-128 key of the frames' GMAC tag."""
    ids: bytes
    """Key of the permutation that hides group sequence numbers."""

    @classmethod
    def derive(cls, secret: bytes, *, from_client: bool) -> FecKeys:
        """The keys of the frames the QUIC client (``from_client``) or server sends."""
        side = b"client" if from_client else b"server"
        return cls(
            mac=hmac.digest(secret, b"gpumesh fec mac " + side, "sha256")[:16],
            ids=hmac.digest(secret, b"gpumesh fec ids " + side, "sha256"),
        )


def _widen(seq32: int, near: int) -> int:
    """The 64-bit sequence number closest to ``near`` whose low 32 bits are ``seq32``
    (as QUIC recovers a packet number from its truncated form)."""
    candidate = (near & ~0xFFFFFFFF) | seq32
    if candidate + (1 << 31) <= near:
        candidate += 1 << 32
    elif candidate > near + (1 << 31) and candidate >= 1 << 32:
        candidate -= 1 << 32
    return candidate


class Sealer:
    """Tags and checks the frames of one direction (:class:`FecKeys`).

    Group ids on the wire are a keyed permutation of the low 32 bits of the group's
    sequence number: a balanced Feistel network of :data:`_ID_ROUNDS` rounds over
    16-bit halves, each round a keyed BLAKE2s. The sender computes it once per group;
    the receiver inverts each id once and keeps the answer for authentic frames.
    """

    def __init__(self, keys: FecKeys) -> None:
        self._gmac = AESGCM(keys.mac)
        # Keyed once: each round copies the state (cheaper than keying BLAKE2s anew).
        self._ids = hashlib.blake2s(key=keys.ids, digest_size=2)

    def _round(self, number: int, half: int) -> int:
        state = self._ids.copy()
        state.update(bytes((number, half >> 8, half & 0xFF)))
        digest = state.digest()
        return digest[0] << 8 | digest[1]

    def group_id(self, seq: int) -> int:
        """The wire id of the group with sequence number ``seq``."""
        left, right = seq >> 16 & 0xFFFF, seq & 0xFFFF
        for number in range(_ID_ROUNDS):
            left, right = right, left ^ self._round(number, right)
        return left << 16 | right

    def sequence(self, group_id: int) -> int:
        """The low 32 bits of the sequence number whose wire id is ``group_id``."""
        left, right = group_id >> 16, group_id & 0xFFFF
        for number in reversed(range(_ID_ROUNDS)):
            left, right = right ^ self._round(number, left), left
        return left << 16 | right

    @staticmethod
    def _nonce(seq: int, frame: bytes) -> bytes:
        # Unique per frame: a sender never reuses a sequence number, and within a
        # group the marker and the index (or which parity) differ.
        return struct.pack("!QBBxx", seq, frame[0], frame[5])

    def tag(self, seq: int, frame: bytes) -> bytes:
        """``frame`` (header and payload) with its tag."""
        return frame + self._gmac.encrypt(self._nonce(seq, frame), b"", frame)

    def check(self, seq: int, frame: bytes) -> bool:
        """Whether ``frame``'s last :data:`TAG` bytes are its tag under ``seq``."""
        body, tag = frame[:-TAG], frame[-TAG:]
        try:
            self._gmac.decrypt(self._nonce(seq, body), tag, body)
        except InvalidTag:
            return False
        return True


@dataclass
class FecCounters:
    """What a codec did, for tests, benchmarks and ``--verbose`` logs."""

    sent_data: int = 0
    sent_parity: int = 0
    received_data: int = 0
    received_parity: int = 0
    repaired: int = 0
    """Datagrams rebuilt from parity."""
    given_up: int = 0
    """Groups that lost more than parity could rebuild (QUIC retransmits)."""
    held: int = 0
    """Datagrams held back behind a gap, then released."""
    dropped: int = 0
    """Frames refused: malformed, truncated, out of range, too large, or forged."""
    forged: int = 0
    """Of those, frames that are not authentic: a tag that does not verify, or a group
    id that no frame of the peer's can carry now (a random one, or a replay of a group
    far behind)."""
    unprotected: int = 0
    """Groups sent without parity (a lone acknowledgement-sized datagram)."""


# --- sender ------------------------------------------------------------------------


def parities_for(k: int, longest: int) -> int:
    """Parity frames for a group of ``k`` datagrams, the longest ``longest`` bytes.

    Two for a group of three or more; one (``P``, which rebuilds either one)
    for a group of one or two; none for a lone acknowledgement-sized datagram
    (at most :data:`SMALL` bytes): QUIC never resends what one carries as such
    (a later ACK covers a lost one), and on an idle long link each keep-alive
    or ACK makes a group of its own, which two parity frames tripled. A decoder
    of any version takes a group without parity: its one datagram passes up at
    once (a group of one has no gap to wait on), and the group is forgotten
    with the oldest.
    """
    if k == 1 and longest <= SMALL:
        return 0
    return PARITIES if k > 2 else 1


class Encoder:
    """Frames one peer's outgoing datagrams and adds parity per group."""

    def __init__(
        self,
        keys: FecKeys,
        *,
        group_size: int = GROUP_SIZE,
        flush_delay: float = FLUSH_DELAY,
    ) -> None:
        if not 1 <= group_size <= MAX_K:
            raise ValueError(f"group size must be 1..{MAX_K}")
        self.group_size = group_size
        self.flush_delay = flush_delay
        self.counters = FecCounters()
        self._sealer = Sealer(keys)
        self._seq = 0
        """The open group's sequence number (64 bits: never wraps, so no nonce repeats)."""
        self._group = self._sealer.group_id(0)
        self._count = 0
        self._longest = 0
        self._opened = 0.0
        self._datagrams: list[bytes] = []
        """The open group's datagrams (symbols are laid out and parity computed at its
        close, in one buffer: cheaper per datagram than a row copy each)."""

    def encode(self, datagrams: list[bytes], now: float) -> list[bytes]:
        """The frames to send for ``datagrams``, parity included where a group fills."""
        frames: list[bytes] = []
        pack, tag = _DATA_HEADER.pack, self._sealer.tag
        for datagram in datagrams:
            if len(datagram) > MAX_PAYLOAD:
                frames.append(datagram)  # never happens with QUIC's datagram size
                continue
            if self._count == 0:
                self._opened = now
            frames.append(tag(self._seq, pack(DATA, self._group, self._count) + datagram))
            self._datagrams.append(datagram)
            self._longest = max(self._longest, len(datagram) + 2)
            self._count += 1
            self.counters.sent_data += 1
            if self._count >= self.group_size:
                self._close(frames)
        return frames

    def flush_at(self) -> float | None:
        """When the open group must be closed (None: no group is open)."""
        return self._opened + self.flush_delay if self._count else None

    def poll(self, now: float) -> list[bytes]:
        """Parity for a group whose time is up (or nothing)."""
        due = self.flush_at()
        return self.flush() if due is not None and now >= due else []

    def flush(self) -> list[bytes]:
        """Close the open group now."""
        frames: list[bytes] = []
        if self._count:
            self._close(frames)
        return frames

    def _close(self, frames: list[bytes]) -> None:
        import numpy as np

        size, k, group = self._longest, self._count, self._group
        parities = parities_for(k, size - 2)
        if parities:
            buffer = bytearray(k * size)  # symbol i: length u16 | datagram | zeros
            at = 0
            for datagram in self._datagrams:
                buffer[at : at + 2] = len(datagram).to_bytes(2, "big")
                buffer[at + 2 : at + 2 + len(datagram)] = datagram
                at += size
            symbols = np.frombuffer(buffer, dtype=np.uint8).reshape(k, size)
            p = np.bitwise_xor.reduce(symbols, axis=0)
            q = _weighted_sum(symbols) if parities > 1 else p
            for which, parity in enumerate((p, q)[:parities]):
                header = _PARITY_HEADER.pack(PARITY, group, which << 6 | k)
                frames.append(self._sealer.tag(self._seq, header + parity.tobytes()))
            self.counters.sent_parity += parities
        else:
            self.counters.unprotected += 1
        self._seq += 1
        self._group = self._sealer.group_id(self._seq & 0xFFFFFFFF)
        self._count = 0
        self._longest = 0
        self._datagrams = []


# --- receiver ----------------------------------------------------------------------


@dataclass
class _Group:
    created: float
    data: dict[int, bytes] = field(default_factory=dict)
    parity: dict[int, bytes] = field(default_factory=dict)
    k: int | None = None
    """Data datagrams in the group: known once a parity frame says so."""
    stored: int = 0
    """Bytes of data and parity kept."""
    highest: int = -1
    gap: bool = False
    """A datagram is missing below one that arrived."""


def _comes_after(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether datagram ``a`` (group, index) was sent after ``b`` (group ids wrap)."""
    if a[0] == b[0]:
        return a[1] > b[1]
    return (a[0] - b[0]) & 0xFFFFFFFF < 1 << 31


class Decoder:
    """Unframes one peer's incoming frames and rebuilds what a group lost."""

    def __init__(
        self,
        keys: FecKeys,
        *,
        hold: bool = True,
        hold_time: float = HOLD_TIME,
        max_groups: int = MAX_GROUPS,
        max_stored: int = MAX_STORED,
        max_held: int = MAX_HELD,
    ) -> None:
        self.hold = hold
        self.hold_time = hold_time
        self.max_groups = max_groups
        self.max_stored = max_stored
        self._stored = 0
        self.max_held = max_held
        self.counters = FecCounters()
        self._sealer = Sealer(keys)
        self._sequences: dict[int, int] = {}
        """Wire group id -> low 32 bits of its sequence number, for authentic frames."""
        self._latest = 0
        """The highest sequence number of an authentic frame so far (the sender's
        first is 0)."""
        self._groups: OrderedDict[int, _Group] = OrderedDict()
        self._finished: OrderedDict[int, None] = OrderedDict()
        self._held: list[bytes] = []
        self._held_at: list[tuple[int, int]] = []
        """(group, index) of each held datagram: where a rebuilt one goes among them."""
        self._hold_group: int | None = None
        self._hold_until = 0.0

    @property
    def open_groups(self) -> int:
        return len(self._groups)

    @property
    def held(self) -> int:
        return len(self._held)

    def receive(self, frame: bytes, now: float) -> list[bytes]:
        """The QUIC datagrams to pass up now, in order (often just the one carried)."""
        out: list[bytes] = []
        opened = self._open_frame(frame)
        if opened is None:
            self.counters.dropped += 1
        else:
            gid, body = opened
            if frame[0] == DATA:
                self._data(gid, body, now, out)
            else:
                self._parity(gid, body, now, out)
        if self._hold_group is not None and self._hold_group not in self._groups:
            out += self._release()  # its group was repaired, completed or pushed out
        out += self.poll(now)
        return out

    def hold_until(self) -> float | None:
        """When held datagrams are released even without a repair (None: none held)."""
        return self._hold_until if self._hold_group is not None else None

    def poll(self, now: float) -> list[bytes]:
        """Release what waited behind a gap too long."""
        if self._hold_group is not None and now >= self._hold_until:
            group = self._hold_group
            if group in self._groups:
                self._finish(group)
                self.counters.given_up += 1
            return self._release()
        return []

    # --- frames --------------------------------------------------------------------

    def _open_frame(self, frame: bytes) -> tuple[int, bytes] | None:
        """The group (the low 32 bits of its sequence number, which order groups) and
        the frame without its tag, or None for a frame that is not authentic."""
        if len(frame) < _SMALLEST or frame[0] not in (DATA, PARITY):
            return None
        wire = int.from_bytes(frame[1:5], "big")
        seq32 = self._sequences.get(wire)
        known = seq32 is not None
        if seq32 is None:
            seq32 = self._sealer.sequence(wire)
        seq = _widen(seq32, self._latest)
        in_window = self._latest - _RECENT < seq <= self._latest + _AHEAD
        if not in_window or not self._sealer.check(seq, frame):
            self.counters.forged += 1
            return None
        if not known:
            if len(self._sequences) >= _IDS_CACHED:
                self._sequences.clear()
            self._sequences[wire] = seq32
        self._latest = max(self._latest, seq)
        return seq32, frame[:-TAG]

    def _data(self, gid: int, frame: bytes, now: float, out: list[bytes]) -> None:
        index = frame[_DATA_HEADER.size - 1]
        datagram = frame[_DATA_HEADER.size :]
        if index >= MAX_K or len(datagram) > MAX_PAYLOAD:
            self.counters.dropped += 1
            return
        self.counters.received_data += 1
        group = None if gid in self._finished else self._open(gid, now)
        if group is not None:
            if index in group.data or (group.k is not None and index >= group.k):
                self.counters.dropped += 1
                return
            group.data[index] = datagram
            self._store(group, len(datagram))
            group.highest = max(group.highest, index)
            group.gap = len(group.data) <= group.highest  # one below the highest is missing
        if self._hold_group is not None:
            self._hold(gid, index, datagram)
        elif group is not None and group.gap and self.hold:
            self._hold_group = gid
            self._hold_until = now + self.hold_time
            self._hold(gid, index, datagram)
        else:
            out.append(datagram)
        if group is not None:
            self._settle(gid, group, out)
        if len(self._held) > self.max_held:
            out += self._release()

    def _parity(self, gid: int, frame: bytes, now: float, out: list[bytes]) -> None:
        packed = frame[_PARITY_HEADER.size - 1]
        which, k = packed >> 6, packed & 0x3F
        payload = frame[_PARITY_HEADER.size :]
        if which >= PARITIES or k == 0 or len(payload) > _SYMBOL or len(payload) < 3:
            self.counters.dropped += 1
            return
        self.counters.received_parity += 1
        if gid in self._finished:
            return
        group = self._open(gid, now)
        if (group.k is not None and group.k != k) or group.highest >= k or which in group.parity:
            self.counters.dropped += 1
            return
        group.k = k
        group.parity[which] = payload
        self._store(group, len(payload))
        if len(group.data) < k:
            group.gap = True  # the parity came after the group: what is missing is known
        self._settle(gid, group, out)

    # --- groups --------------------------------------------------------------------

    def _open(self, gid: int, now: float) -> _Group:
        group = self._groups.get(gid)
        if group is None:
            group = _Group(created=now)
            self._groups[gid] = group
            while len(self._groups) > self.max_groups:
                self._finish(next(iter(self._groups)))  # the oldest first
        return group

    @staticmethod
    def _missing(group: _Group) -> list[int]:
        top = group.k if group.k is not None else group.highest + 1
        return [i for i in range(top) if i not in group.data]

    def _settle(self, gid: int, group: _Group, out: list[bytes]) -> None:
        """Repair the group if parity allows; finish it once complete."""
        if group.k is None:
            return
        missing = self._missing(group)
        if missing and len(missing) <= len(group.parity):
            # A group after the one a hold waits on queues its rebuilt datagrams
            # behind the held ones: passed up at once they would reach QUIC ahead of
            # everything held, and QUIC would take all of that for lost.
            behind = self._behind_hold(gid)
            for index, datagram in self._repair(group, missing):
                group.data[index] = datagram
                self.counters.repaired += 1
                if behind:
                    self._hold(gid, index, datagram)
                else:
                    out.append(datagram)
            missing = []
        if not missing:
            self._finish(gid)

    def _hold(self, gid: int, index: int, datagram: bytes) -> None:
        """Hold ``datagram`` in its place: after every held one sent before it (a rebuilt
        datagram arrives after later ones of its group, with the parity)."""
        at = len(self._held)
        while at and _comes_after(self._held_at[at - 1], (gid, index)):
            at -= 1
        self._held.insert(at, datagram)
        self._held_at.insert(at, (gid, index))
        self.counters.held += 1

    def _behind_hold(self, gid: int) -> bool:
        """Whether group ``gid`` came after the group a hold waits on (ids wrap)."""
        hold = self._hold_group
        return hold is not None and gid != hold and (gid - hold) & 0xFFFFFFFF < 1 << 31

    def _repair(self, group: _Group, missing: list[int]) -> list[tuple[int, bytes]]:
        import numpy as np

        assert group.k is not None
        size = max(len(p) for p in group.parity.values())
        rows = np.zeros((group.k, size), dtype=np.uint8)  # a missing one's row stays 0
        for index, datagram in group.data.items():
            symbol = _symbol(datagram)[:size]
            rows[index, : len(symbol)] = symbol
        known_p = np.bitwise_xor.reduce(rows, axis=0)
        known_q = _weighted_sum(rows)
        p = q = None
        if 0 in group.parity:
            p = np.zeros(size, dtype=np.uint8)
            raw = np.frombuffer(group.parity[0], dtype=np.uint8)
            p[: len(raw)] = raw
            p ^= known_p  # the sum of the missing symbols
        if 1 in group.parity:
            q = np.zeros(size, dtype=np.uint8)
            raw = np.frombuffer(group.parity[1], dtype=np.uint8)
            q[: len(raw)] = raw
            q ^= known_q  # the weighted sum of the missing symbols
        symbols: list[tuple[int, npt.NDArray[np.uint8]]]
        if len(missing) == 1:
            x = missing[0]
            if p is not None:
                symbols = [(x, p)]
            else:
                assert q is not None
                symbols = [(x, _scale(_inv(_EXP[x]), q))]
        else:
            assert p is not None and q is not None
            x, y = missing
            # D_x ^ D_y = p ; g^x D_x ^ g^y D_y = q  =>  D_x = (g^y p ^ q) / (g^x ^ g^y)
            gx, gy = _EXP[x], _EXP[y]
            d_x = _scale(_inv(gx ^ gy), _scale(gy, p) ^ q)
            symbols = [(x, d_x), (y, d_x ^ p)]
        repaired: list[tuple[int, bytes]] = []
        for index, symbol in symbols:
            length = int(symbol[0]) << 8 | int(symbol[1])
            if length + 2 > size:
                self.counters.dropped += 1  # parity that does not add up: not ours
                continue
            repaired.append((index, symbol[2 : 2 + length].tobytes()))
        return repaired

    @property
    def stored(self) -> int:
        """Bytes kept for open groups."""
        return self._stored

    def _store(self, group: _Group, size: int) -> None:
        group.stored += size
        self._stored += size
        while self._stored > self.max_stored and len(self._groups) > 1:
            self._finish(next(iter(self._groups)))  # the oldest first

    def _finish(self, gid: int) -> None:
        group = self._groups.pop(gid, None)
        if group is not None:
            self._stored -= group.stored
        self._finished[gid] = None
        while len(self._finished) > _RECENT:
            self._finished.popitem(last=False)

    def _release(self) -> list[bytes]:
        held, self._held = self._held, []
        self._held_at = []
        self._hold_group = None
        return held
