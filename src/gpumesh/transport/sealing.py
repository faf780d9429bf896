"""Sealed frames: a desktop connection's own framing once its TLS has done its part.

A desktop connection's data channel opens as TLS 1.3 (the provider's key pinned,
the ticket presented first). When both ends agreed on it over the QUIC request
(``DesktopOpen.sealing``, ``DesktopOpened.sealing``), each end then sends
:data:`RANDOM_BYTES` random bytes through that TLS, and from then on the bytes
move in frames of this module's instead of TLS records: fewer, larger pieces
(up to :data:`MAX_PLAIN` bytes each instead of 16 KiB), each sealed and opened
with one call into the AEAD, straight from and into preallocated buffers.

* Keys: HKDF-SHA256 over both randoms (the dialler's first), one key per
  direction (the labels differ), so neither end's frames can be reflected back
  to it; the binding of the QUIC session whose request agreed on the switch
  (:func:`gpumesh.transport.quicsetup.session_binding`, a secret of that session's
  TLS 1.3 key schedule) is mixed in. The randoms crossed the authenticated
  channel TLS, so only the two ends know them, and they are fresh per
  connection: so are the keys. Version 1 mixed in the channel TLS's
  ``tls-unique`` instead, which TLS 1.3 leaves undefined (OpenSSL hands back the
  client Finished); Python's ``ssl`` offers no exporter (RFC 9266) to replace it,
  so version 2 binds to the QUIC session, and a version-1 peer keeps TLS records.
* A frame: its ciphertext's length (4 bytes, big-endian) then the AES-128-GCM
  ciphertext and tag. The length is the associated data. The nonce is the
  direction's frame counter (96 bits, never sent): a frame dropped, replayed or
  moved fails to open, as does a changed byte.
* End of stream: a frame whose plaintext is empty (data frames never are). A
  stream that stops without it was cut (truncation), and is an error.
* Every :data:`REKEY_FRAMES` frames a direction's key is replaced by one derived
  from it (as TLS 1.3's KeyUpdate), which keeps each key far below AES-GCM's
  usage limit; a counter that would wrap ends the connection.

Nothing here owns a socket: :class:`Sealer` writes a frame into a buffer the
caller sends, :class:`Opener` takes bytes the caller received into its buffer and
gives back plaintexts. Their ``pump`` methods are the same work as a loop for a
connection's life, given the two calls that read and send: the small-message
path of a desktop tunnel, so each frame costs a handful of interpreter steps
beside its AEAD call (locals bound once, buffers and the nonce preallocated, a
frame opened straight from the buffer one read filled). See
:mod:`gpumesh.transport.tcpstream` for the splice that uses them.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF, HKDFExpand

from gpumesh.protocol.handshake import BINDING_SIZE

__all__ = [
    "FRAMING_VERSION",
    "HEADER",
    "MAX_FRAME",
    "MAX_PLAIN",
    "RANDOM_BYTES",
    "REKEY_FRAMES",
    "TAG",
    "Opener",
    "ReadFailed",
    "SealError",
    "Sealer",
    "SendFailed",
    "derive_keys",
]

FRAMING_VERSION = 2
"""The sealed framing this code speaks (0, on the wire: TLS records only). Version
1 (keys bound to ``tls-unique``) is never agreed: a peer that speaks only it gets
TLS records."""
RANDOM_BYTES = 32
"""What each end sends through TLS before the switch."""
MAX_PLAIN = 256 * 1024
"""Most plaintext bytes per frame: large enough that the interpreter's share per
byte is small, small enough that a frame's copies stay in cache."""
TAG = 16
HEADER = 4
MAX_FRAME = HEADER + MAX_PLAIN + TAG
"""Most bytes one frame takes on the wire."""
KEY_BYTES = 16
"""AES-128: the fastest AEAD cryptography offers on this hardware (measured beside
AES-256-GCM and ChaCha20-Poly1305). The channel TLS it takes over from negotiates
TLS_AES_256_GCM_SHA384 (Python's ``ssl`` offers no TLS 1.3 cipher choice); 128-bit
keys are what TLS 1.3's own mandatory suite, TLS_AES_128_GCM_SHA256, uses."""
REKEY_FRAMES = 1 << 16
"""Frames per key: at most 16 GiB, far below AES-GCM's per-key limit (TLS 1.3
allows about 2^24.5 full records, some 370 GiB)."""
_COUNTER_END = 1 << 96
_LENGTH = struct.Struct(">I")
_NONCE = struct.Struct(">IQ")
"""The frame counter as a nonce, written in place: its high 32 bits, its low 64."""
_LOW = (1 << 64) - 1
_SMALL = 1024
"""Plaintexts up to this size have their buffers' views made once per pump and
kept (a request, a key press, a pointer move): no memoryview made per frame."""
_SALT = b"gpumesh desktop sealed frames v2"
_LABELS = (b"dialler to acceptor", b"acceptor to dialler")
_NEXT = b"gpumesh sealed next key"


class SealError(Exception):
    """A frame failed: tampered, replayed, moved, malformed, or the stream was cut."""


class ReadFailed(Exception):
    """A pump's call that reads raised an OSError (its ``__cause__``)."""


class SendFailed(Exception):
    """A pump's call that sends raised an OSError (its ``__cause__``)."""


ReadInto = Callable[[memoryview], int]
"""Reads into the buffer it is given (blocking); how many bytes, 0 at the end."""
Send = Callable[[memoryview], object]
"""Sends all of what it is given (blocking)."""


def derive_keys(
    dialler_random: bytes, acceptor_random: bytes, binding: bytes
) -> tuple[bytes, bytes]:
    """The two directions' keys: (dialler to acceptor, acceptor to dialler).
    ``binding``: the binding of the QUIC session whose request agreed on sealed
    frames (:data:`~gpumesh.protocol.handshake.BINDING_SIZE` bytes), which ties
    the keys to that one session too."""
    if len(dialler_random) != RANDOM_BYTES or len(acceptor_random) != RANDOM_BYTES:
        raise SealError(f"a sealed-frame random must be {RANDOM_BYTES} bytes")
    if len(binding) != BINDING_SIZE:
        raise SealError(f"a QUIC session binding is {BINDING_SIZE} bytes, not {len(binding)}")
    secret = dialler_random + acceptor_random
    up, down = (
        HKDF(hashes.SHA256(), KEY_BYTES, _SALT, label + b"\0" + binding).derive(secret)
        for label in _LABELS
    )
    return up, down


class _Direction:
    """One direction's key and frame counter (the nonce)."""

    def __init__(self, key: bytes) -> None:
        self.counter = 0
        """The next frame's number: its nonce."""
        self.until = REKEY_FRAMES
        """The counter at which the key moves on (and the wrap is checked)."""
        self._use(key)

    def _use(self, key: bytes) -> None:
        self._key = key
        aead = AESGCM(key)
        self.encrypt_into, self.decrypt_into = aead.encrypt_into, aead.decrypt_into

    def next_key(self) -> None:
        """At :attr:`until`: the next key (as TLS 1.3's KeyUpdate), or the end when
        the counter would wrap."""
        if self.counter >= _COUNTER_END - REKEY_FRAMES:
            raise SealError("the frame counter would wrap: the connection must end")
        self._use(HKDFExpand(hashes.SHA256(), KEY_BYTES, _NEXT).derive(self._key))
        self.until = self.counter + REKEY_FRAMES


class Sealer:
    """The sending direction: plaintext in, a whole frame (header, ciphertext, tag) out."""

    def __init__(self, key: bytes) -> None:
        self._direction = _Direction(key)
        self.ended = False

    def seal_into(self, plain: bytes | bytearray | memoryview, out: memoryview) -> int:
        """Write the frame of ``plain`` (1 to :data:`MAX_PLAIN` bytes; empty: the
        end of the stream, after which nothing may be sealed) at the start of
        ``out``; the frame's length. ``out`` must not overlap ``plain``."""
        if self.ended:
            raise SealError("nothing may follow the end of the stream")
        size = len(plain)
        if size > MAX_PLAIN:
            raise ValueError(f"a frame carries at most {MAX_PLAIN} bytes, not {size}")
        direction = self._direction
        counter = direction.counter
        if counter == direction.until:
            direction.next_key()
        direction.counter = counter + 1
        length = size + TAG
        _LENGTH.pack_into(out, 0, length)
        direction.encrypt_into(
            counter.to_bytes(12, "big"), plain, out[:HEADER], out[HEADER : HEADER + length]
        )
        if not size:
            self.ended = True
        return HEADER + length

    def seal(self, plain: bytes | bytearray | memoryview) -> bytes:
        """:meth:`seal_into` a new buffer (for tests and small frames)."""
        out = bytearray(HEADER + len(plain) + TAG)
        self.seal_into(plain, memoryview(out))
        return bytes(out)

    def pump(self, read_into: ReadInto, send: Send) -> None:
        """Seal what each ``read_into`` brings as one frame and ``send`` it, until a
        read brings nothing: then return, the end of the stream not sealed (the
        caller seals it with :meth:`seal_into` once it knows the read was an end
        and not a stop). Frames as :meth:`seal_into` makes them; an OSError of
        either call is raised as :class:`ReadFailed` or :class:`SendFailed`."""
        if self.ended:
            raise SealError("nothing may follow the end of the stream")
        plain = memoryview(bytearray(MAX_PLAIN))
        frame = memoryview(bytearray(MAX_FRAME))
        header = frame[:HEADER]
        nonce = bytearray(12)
        pack_length, pack_nonce = _LENGTH.pack_into, _NONCE.pack_into
        low, small = _LOW, _SMALL
        kept: list[tuple[memoryview, memoryview, memoryview] | None] = [None] * (small + 1)
        """By plaintext size: the plaintext's view, the ciphertext's, the frame's."""
        direction = self._direction
        encrypt, counter, until = direction.encrypt_into, direction.counter, direction.until
        try:
            while True:
                try:
                    count = read_into(plain)
                except OSError as exc:
                    raise ReadFailed() from exc
                if not count:
                    return
                if counter == until:
                    direction.counter = counter
                    direction.next_key()
                    encrypt, until = direction.encrypt_into, direction.until
                pack_nonce(nonce, 0, counter >> 64, counter & low)
                counter += 1
                pack_length(header, 0, TAG + count)
                if count <= small:
                    views = kept[count]
                    if views is None:
                        end = HEADER + TAG + count
                        views = kept[count] = (plain[:count], frame[HEADER:end], frame[:end])
                    source, sealed, whole = views
                else:
                    end = HEADER + TAG + count
                    source, sealed, whole = plain[:count], frame[HEADER:end], frame[:end]
                encrypt(nonce, source, header, sealed)
                try:
                    send(whole)
                except OSError as exc:
                    raise SendFailed() from exc
        finally:
            direction.counter = counter


class Opener:
    """The receiving direction: bytes received into :meth:`room`, frames opened in order.

    The buffer holds up to two frames: a partial frame at its end is moved to its
    start only when the room after it could not take the rest.
    """

    def __init__(self, key: bytes, initial: bytes = b"") -> None:
        self._direction = _Direction(key)
        self._buffer = bytearray(2 * MAX_FRAME)
        self._view = memoryview(self._buffer)
        self._start = 0
        self._end = 0
        self.ended = False
        """The end-of-stream frame was opened: nothing may follow it."""
        if initial:
            self.feed(initial)

    @property
    def buffered(self) -> int:
        """Bytes received and not yet opened."""
        return self._end - self._start

    def room(self) -> memoryview:
        """Where the next bytes received go (never empty while a frame is missing)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._buffer) - self._end < MAX_FRAME:
            # What is left is less than one frame: move it to the front.
            count = self._end - self._start
            self._view[:count] = self._view[self._start : self._end]
            self._start, self._end = 0, count
        return self._view[self._end :]

    def filled(self, count: int) -> None:
        """``count`` bytes were received into :meth:`room`."""
        self._end += count

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes received elsewhere (the tail of the handshake's reads)."""
        while data:
            room = self.room()
            take = min(len(room), len(data))
            room[:take] = data[:take]
            self.filled(take)
            data = data[take:]

    def open_into(self, out: memoryview) -> int | None:
        """Open the next whole frame into ``out`` (room for :data:`MAX_PLAIN`): its
        plaintext's length (0: the end of the stream), or None while it is not all
        here. Raises :class:`SealError` for anything but a genuine next frame."""
        if self.ended:
            if self._end > self._start:
                raise SealError("bytes followed the end of the stream")
            return None
        start, available = self._start, self._end - self._start
        if available < HEADER:
            return None
        length: int = _LENGTH.unpack_from(self._buffer, start)[0]
        if length < TAG or length > MAX_PLAIN + TAG:
            raise SealError(f"a frame of {length} bytes (at most {MAX_PLAIN + TAG})")
        if available < HEADER + length:
            return None
        view = self._view
        direction = self._direction
        counter = direction.counter
        if counter == direction.until:
            direction.next_key()
        direction.counter = counter + 1
        size = length - TAG
        body = start + HEADER
        try:
            direction.decrypt_into(
                counter.to_bytes(12, "big"),
                view[body : body + length],
                view[start:body],
                out[:size],
            )
        except InvalidTag:
            raise SealError("a frame failed its authentication") from None
        self._start = start + HEADER + length
        if not size:
            self.ended = True
            if self._end > self._start:
                raise SealError("bytes followed the end of the stream")
        return size

    def pump(self, read_into: ReadInto, send: Send) -> None:
        """Open the frames ``read_into`` brings into the buffer and ``send`` each
        plaintext, until the end-of-stream frame: then return. What is buffered
        goes first; a frame all in one read is opened where it landed. Refuses as
        :meth:`open_into` and :meth:`cut` do (:class:`SealError`; a read that
        brings nothing before the end is a cut); an OSError of either call is
        raised as :class:`ReadFailed` or :class:`SendFailed`."""
        if self.ended:
            raise SealError("nothing may follow the end of the stream")
        buffer, view = self._buffer, self._view
        plain = memoryview(bytearray(MAX_PLAIN))
        header = view[:HEADER]
        nonce = bytearray(12)
        unpack_length, pack_nonce = _LENGTH.unpack_from, _NONCE.pack_into
        low, small = _LOW, _SMALL + TAG
        kept: list[tuple[memoryview, memoryview] | None] = [None] * (small + 1)
        """By ciphertext length, for a frame at the buffer's front: its
        ciphertext's view, the plaintext's."""
        direction = self._direction
        decrypt, counter, until = direction.decrypt_into, direction.counter, direction.until
        start, end = self._start, self._end
        last_room = len(buffer) - MAX_FRAME
        """Past this, a partial frame is moved to the front before the next read."""
        try:
            while True:
                while end - start >= HEADER:
                    length: int = unpack_length(buffer, start)[0]
                    if length < TAG or length > MAX_PLAIN + TAG:
                        raise SealError(f"a frame of {length} bytes (at most {MAX_PLAIN + TAG})")
                    body = start + HEADER
                    stop = body + length
                    if stop > end:
                        break
                    if counter == until:
                        direction.counter = counter
                        direction.next_key()
                        decrypt, until = direction.decrypt_into, direction.until
                    pack_nonce(nonce, 0, counter >> 64, counter & low)
                    counter += 1
                    size = length - TAG
                    if not start and length <= small:  # the usual case: one read, one frame
                        views = kept[length]
                        if views is None:
                            views = kept[length] = (view[HEADER:stop], plain[:size])
                        sealed, opened = views
                        associated = header
                    else:
                        sealed, associated, opened = view[body:stop], view[start:body], plain[:size]
                    try:
                        decrypt(nonce, sealed, associated, opened)
                    except InvalidTag:
                        raise SealError("a frame failed its authentication") from None
                    start = stop
                    if not size:
                        self.ended = True
                        if end > start:
                            raise SealError("bytes followed the end of the stream")
                        return
                    try:
                        send(opened)
                    except OSError as exc:
                        raise SendFailed() from exc
                if start == end:  # the usual case: all opened, the next read at the front
                    start = end = 0
                    room = view
                else:
                    if end > last_room:
                        count = end - start
                        view[:count] = view[start:end]
                        start, end = 0, count
                    room = view[end:]
                try:
                    got = read_into(room)
                except OSError as exc:
                    raise ReadFailed() from exc
                if not got:
                    raise SealError(
                        "it ended in the middle of the connection (no end-of-stream frame)"
                    )
                end += got
        finally:
            self._start, self._end = start, end
            direction.counter = counter

    def cut(self) -> None:
        """The stream's bytes ended (a TCP EOF): an error unless its end was sealed."""
        if not self.ended:
            raise SealError("it ended in the middle of the connection (no end-of-stream frame)")
