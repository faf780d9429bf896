"""The data channel: file bytes over TLS on TCP, opened by an authenticated QUIC session.

One QUIC connection driven from Python tops out well under what the disk and
TLS can do (every packet costs interpreter time). When a direct path exists,
a copy asks over its QUIC request for a data channel: the provider opens a
one-shot TCP listener and answers with its port and a random ticket; the
consumer connects, runs TLS 1.3, pins the provider's Ed25519 key exactly as
the QUIC dial does, and sends the ticket first. The provider compares the
ticket (constant time) before it reads a byte of the file. Then only raw file
bytes cross the channel; everything else (what is copied, where it resumes,
the hash of the whole file, the verdict) stays on the QUIC request.

Both ends ask the kernel for BBR on the channel's socket where it offers it:
over a long link with random loss, a loss-based congestion control (cubic,
reno) takes every lost packet for congestion and stalls, where BBR keeps the
link full. Where BBR is missing (or not allowed) the socket keeps the
system's default; either way the channel says which one it has.

The listener takes connections only from the IP address the QUIC request
came from; any other is closed unread, and one from that address that fails
its handshake or shows a wrong ticket is closed too. Neither ends the
listener: another process may connect first (anyone, on a shared machine or
on loopback), and must not be able to break the copy by doing so. It keeps
waiting until the right ticket arrives or its window closes.

This module holds the blocking halves both ends use, run on threads: the TLS
contexts, the one-shot listener, dialling with the key pin, and pumping a file
into or out of a socket in large pieces while another thread hashes (TLS and
the hash both release the GIL, so they run on two cores). A tar (a folder, a
job's workdir, an app's files) is pumped the same way: its size is exact and
known before a byte is packed, so the channel carries exactly that many bytes
with no framing of its own, written by the packer on the sending thread and
read by the unpacker on the receiving one. It knows nothing of
peers, sandboxes or asyncio; a timeout on the socket turns a stalled link into
``ConnectionLostError``.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import logging
import os
import queue
import selectors
import socket
import ssl
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Generator, Iterator
from functools import partial
from typing import TYPE_CHECKING, TypeVar

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from gpumesh import platform
from gpumesh.errors import (
    AccessDeniedError,
    ConfigError,
    ConnectionLostError,
    GPUMeshError,
    KeyMismatchError,
    ProtocolError,
    UnreachableError,
)
from gpumesh.files.transfer import hash_file
from gpumesh.identity.tlscert import public_key_from_spki, self_signed_certificate_pem

if TYPE_CHECKING:
    from gpumesh.files.transfer import Hasher
    from gpumesh.identity.keys import Identity

__all__ = [
    "ACCEPT_WAIT",
    "HELD",
    "PREFERRED_CONGESTION",
    "TICKET_BYTES",
    "Channel",
    "Listener",
    "MemoryChannel",
    "check_pin",
    "client_context",
    "congestion_of",
    "dial",
    "dial_memory",
    "receive_file",
    "receive_stream",
    "send_file",
    "send_stream",
    "server_context",
    "wrap_tls",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

TICKET_BYTES = 32
ACCEPT_WAIT = 5.0
"""Seconds a one-shot listener waits for its peer's connection, TLS handshake and
ticket, whatever else connects meanwhile."""
CONNECT_WAIT = 3.0
"""Seconds the consumer gives a TCP connect and TLS handshake before it falls back."""
PIECE = 4 << 20
"""Bytes per read/send/write: large, so the interpreter's share per byte is small."""
_PIECES = 4
"""Buffers in flight per transfer (``PIECE`` each): bounded memory, whatever the size."""
HELD = PIECE * _PIECES
"""Most bytes one pump holds in its buffers, whatever the size of what it moves."""
_POLL = 0.2
_MAX_PENDING = 8
"""Connections from the peer's address in their handshake at once; a new one
past this closes the oldest (the peer's own connection comes last, after any
that raced it)."""
_BACKLOG = 16
PREFERRED_CONGESTION = "bbr"
"""The TCP congestion control the channel asks for (model-based: random loss does
not make it back off the way it makes cubic or reno back off)."""
_TCP_CONGESTION: int | None = getattr(socket, "TCP_CONGESTION", None)
"""Linux only; elsewhere the channel keeps the system's congestion control."""
_CONGESTION_NAME_MAX = 16  # TCP_CA_NAME_MAX


def _prefer_bbr(sock: socket.socket) -> None:
    """Ask for :data:`PREFERRED_CONGESTION` on ``sock``; keep the default where refused.

    The kernel refuses a name it has no module for (ENOENT) or one that an
    unprivileged process may not pick (EPERM, not in
    ``tcp_allowed_congestion_control``): both leave the default in place.
    """
    if _TCP_CONGESTION is None:
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_CONGESTION, PREFERRED_CONGESTION.encode())


def congestion_of(sock: socket.socket) -> str:
    """The TCP congestion control ``sock`` has, as the kernel names it (``""``: unknown)."""
    if _TCP_CONGESTION is None:
        return ""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, _TCP_CONGESTION, _CONGESTION_NAME_MAX)
    except OSError:
        return ""
    return raw.split(b"\0", 1)[0].decode("ascii", "replace")


def server_context(identity: Identity) -> ssl.SSLContext:
    """TLS 1.3 with the node's self-signed Ed25519 certificate (the one QUIC presents)."""

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.num_tickets = 0  # no resumption; and nothing unread left behind at close
    pem = self_signed_certificate_pem(identity) + identity.private_pem()
    # ssl loads certificates from a path only: an anonymous memory file keeps
    # the private key off the disk; where there is none, a private temp file.
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("gpumesh-cert", os.MFD_CLOEXEC)
        try:
            os.write(fd, pem)
            context.load_cert_chain(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
    else:
        with tempfile.NamedTemporaryFile(prefix="gpumesh-cert-") as handle:
            handle.write(pem)
            handle.flush()
            context.load_cert_chain(handle.name)
    return context


def client_context() -> ssl.SSLContext:
    """TLS 1.3 without a CA: the caller pins the provider's key instead."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def wrap_tls(
    context: ssl.SSLContext, conn: socket.socket, *, server_side: bool = False
) -> ssl.SSLSocket:
    """``context.wrap_socket(conn)``, never leaving a socket open when it fails; a
    server's handshake is left to the caller (``do_handshake_on_connect`` off).

    The TLS socket takes ``conn``'s descriptor over before it looks at the
    connection, and a peer that reset it meanwhile (a dial given up) makes it
    raise with that new socket neither closed nor returned: it is closed here.
    """
    try:
        return context.wrap_socket(
            conn, server_side=server_side, do_handshake_on_connect=not server_side
        )
    except BaseException as exc:
        for frame, _line in traceback.walk_tb(exc.__traceback__):
            made = frame.f_locals.get("self")
            if isinstance(made, ssl.SSLSocket):
                with contextlib.suppress(OSError):
                    made.close()
        raise


class Channel:
    """One TLS connection carrying one file's bytes.

    :meth:`abort` and :meth:`close` may be called from any thread: a close
    while a pump still uses the socket only aborts it, and the pump closes it
    when it lets go.
    """

    def __init__(self, sock: ssl.SSLSocket) -> None:
        self.sock = sock
        self.congestion = congestion_of(sock)
        """The socket's TCP congestion control (``bbr`` where the kernel offers it)."""
        logger.info("data channel: TCP congestion control %s", self.congestion or "unknown")
        self.aborted = False
        """Whether :meth:`abort` (or :meth:`close`) was called."""
        self._lock = threading.Lock()
        self._busy = False
        self._closing = False

    def abort(self) -> None:
        """Unblock a thread sending or receiving (a plain close would not)."""
        self.aborted = True
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)

    def close(self) -> None:
        self.abort()
        with self._lock:
            self._closing = True
            if self._busy:
                return
        with contextlib.suppress(OSError):
            self.sock.close()

    @contextlib.contextmanager
    def using(self) -> Iterator[ssl.SSLSocket]:
        """The socket, for one pump at a time."""
        with self._lock:
            if self._closing:
                raise ConnectionLostError("the data channel was closed")
            self._busy = True
        try:
            yield self.sock
        finally:
            if self._release():
                with contextlib.suppress(OSError):
                    self.sock.close()

    def _release(self) -> bool:
        """Let go of the socket; whether it should be closed now."""
        with self._lock:
            self._busy = False
            return self._closing


class Listener:
    """A TCP listener for one connection from its peer bearing its ticket; closed after it.

    ``peer`` is the IP address the QUIC request came from: connections from
    anywhere else are closed before a byte is read.
    """

    def __init__(self, host: str, context: ssl.SSLContext, ticket: bytes, *, peer: str) -> None:
        peer_ip = _ip(peer)
        if peer_ip is None:
            raise ValueError(f"the data channel's peer {peer!r} is not an IP address")
        self.peer = peer_ip
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        # Accepted sockets take the listener's congestion control.
        _prefer_bbr(sock)
        try:
            sock.bind((host, 0))
            sock.listen(_BACKLOG)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._context = context
        self.ticket = ticket
        """What the peer's connection must present first."""
        self._stopped = threading.Event()
        self.port: int = sock.getsockname()[1]

    def stop(self) -> None:
        """Give up waiting (thread-safe): :meth:`accept` returns within a fraction of a second."""
        self._stopped.set()

    def close(self) -> None:
        """Stop listening now (only from the thread that owns the listener)."""
        self._stopped.set()
        self._sock.close()

    def accept(self, stall_timeout: float, wait: float | None = None) -> Channel:
        """The peer's connection, its handshake done and its ticket checked (blocking);
        as :meth:`accept_memory`, with Python's TLS socket (a file's pump)."""
        return self._accept(wait, _Candidate).channel(stall_timeout)

    def accept_memory(self, wait: float | None = None) -> MemoryChannel:
        """:meth:`accept` for a desktop connection: its TLS on memory buffers
        (:class:`MemoryChannel`), the socket left blocking without a timeout."""
        return self._accept(wait, _MemoryCandidate).channel()

    def _accept(self, wait: float | None, kind: _Kind[_C]) -> _C:
        """The peer's connection, its handshake done and its ticket checked (blocking).

        Waits up to ``wait`` seconds (default :data:`ACCEPT_WAIT`). Connections
        from other addresses, and those from the peer's address that fail
        their handshake or show a wrong ticket, are closed before a byte of
        the file moves, and the wait goes on. Whatever happens, the listener
        is closed before this returns: nothing is accepted after the one.
        """
        deadline = time.monotonic() + (ACCEPT_WAIT if wait is None else wait)
        pending: list[_C] = []
        wrong_tickets = 0
        try:
            with selectors.DefaultSelector() as selector:
                self._sock.setblocking(False)
                selector.register(self._sock, selectors.EVENT_READ)
                while True:
                    if self._stopped.is_set():
                        raise ConnectionLostError(
                            "the request ended before its data channel opened"
                        )
                    left = deadline - time.monotonic()
                    if left <= 0:
                        if wrong_tickets:
                            raise AccessDeniedError(
                                "the data channel was opened with a wrong ticket, "
                                "and not with the right one in time"
                            )
                        raise UnreachableError("nobody opened the data channel in time")
                    for key, _events in selector.select(min(left, _POLL)):
                        if key.fileobj is self._sock:
                            self._take(selector, pending, kind)
                            continue
                        candidate: _C = key.data
                        outcome = candidate.step()
                        if outcome is None:
                            selector.modify(candidate.sock, candidate.events, candidate)
                            continue
                        selector.unregister(candidate.sock)
                        pending.remove(candidate)
                        if outcome:
                            return candidate
                        wrong_tickets += candidate.wrong_ticket
                        candidate.close()
        finally:
            self._sock.close()
            for candidate in pending:
                candidate.close()

    def _take(self, selector: selectors.BaseSelector, pending: list[_C], kind: _Kind[_C]) -> None:
        """Accept what is queued: the peer's address gets a handshake, others a close."""
        while True:
            try:
                conn, address = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. reset while it was queued
                logger.debug("data channel: accept failed: %s", exc)
                return
            if _ip(address[0]) != self.peer:
                logger.debug("data channel: closed a connection from %s: not the peer", address[0])
                conn.close()
                continue
            try:
                conn.setblocking(False)
                candidate = kind(conn, self._context, self.ticket)
            except (OSError, ssl.SSLError) as exc:
                logger.debug("data channel: a connection from %s failed: %s", address[0], exc)
                conn.close()
                continue
            if len(pending) >= _MAX_PENDING:
                oldest = pending.pop(0)
                selector.unregister(oldest.sock)
                oldest.close()
            pending.append(candidate)
            selector.register(candidate.sock, candidate.events, candidate)


class _Pending:
    """One connection from the peer's address, in its handshake and ticket (non-blocking):
    what :meth:`Listener._accept` drives."""

    def __init__(self, sock: socket.socket, ticket: bytes) -> None:
        self.sock = sock
        self._ticket = ticket
        self._handshaken = False
        self._presented = bytearray()
        self.events = selectors.EVENT_READ
        """What :meth:`step` waits for next."""
        self.wrong_ticket = False

    def step(self) -> bool | None:
        """Go as far as it can: True (the ticket matched), False (refused), None (wait)."""
        raise NotImplementedError

    def _ticket_matches(self) -> bool:
        if hmac.compare_digest(bytes(self._presented), self._ticket):
            return True
        logger.debug("data channel: closed a connection with a wrong ticket")
        self.wrong_ticket = True
        return False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class _Candidate(_Pending):
    """A connection whose TLS is Python's TLS socket (a file's pump)."""

    sock: ssl.SSLSocket

    def __init__(self, conn: socket.socket, context: ssl.SSLContext, ticket: bytes) -> None:
        super().__init__(wrap_tls(context, conn, server_side=True), ticket)

    def step(self) -> bool | None:
        try:
            if not self._handshaken:
                self.sock.do_handshake()
                self._handshaken = True
            # Read until the socket would block: TLS may hold bytes it has already
            # taken from the socket, which select() would never report.
            while len(self._presented) < TICKET_BYTES:
                piece = self.sock.recv(TICKET_BYTES - len(self._presented))
                if not piece:
                    return False
                self._presented += piece
        except ssl.SSLWantReadError:
            self.events = selectors.EVENT_READ
            return None
        except ssl.SSLWantWriteError:
            self.events = selectors.EVENT_WRITE
            return None
        except (OSError, ssl.SSLError) as exc:
            logger.debug("data channel: a connection from the peer's address failed: %s", exc)
            return False
        return self._ticket_matches()

    def channel(self, stall_timeout: float) -> Channel:
        self.sock.setblocking(True)
        self.sock.settimeout(stall_timeout)
        return Channel(self.sock)


class MemoryChannel:
    """One TLS connection whose TLS runs on memory buffers: a desktop connection's.

    ``tls`` encrypts into ``outgoing`` and decrypts from ``incoming``; moving the
    bytes between those and the plain TCP socket ``sock`` is the caller's (a
    splice: one ``recv`` feeds many records, and many records leave in one
    ``send``, none of it under the lock OpenSSL needs). The socket is blocking,
    without a timeout. The TLS is the same as :class:`Channel`'s (TLS 1.3, the
    key pinned, the ticket presented first): the far end cannot tell them apart.
    """

    def __init__(
        self,
        sock: socket.socket,
        tls: ssl.SSLObject,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
    ) -> None:
        self.sock = sock
        self.tls = tls
        self.incoming = incoming
        self.outgoing = outgoing

    def close(self) -> None:
        """Close the socket (any thread): a thread blocked on it is woken first."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


class _MemoryCandidate(_Pending):
    """A connection with its TLS on memory buffers (a desktop connection)."""

    def __init__(self, conn: socket.socket, context: ssl.SSLContext, ticket: bytes) -> None:
        super().__init__(conn, ticket)
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        self._unsent = b""

    def step(self) -> bool | None:
        try:
            if self._unsent:  # the handshake's answer, not all taken by the kernel
                self._unsent = self._unsent[self.sock.send(self._unsent) :]
                if self._unsent:
                    return None
                self.events = selectors.EVENT_READ
            while True:
                try:
                    if not self._handshaken:
                        self._tls.do_handshake()
                        self._handshaken = True
                    while len(self._presented) < TICKET_BYTES:
                        piece = self._tls.read(TICKET_BYTES - len(self._presented))
                        if not piece:
                            return False
                        self._presented += piece
                    break
                except ssl.SSLWantReadError:
                    if self._flush():
                        return None
                    data = self.sock.recv(65536)
                    if not data:
                        return False
                    self._incoming.write(data)
        except (BlockingIOError, InterruptedError):
            return None
        except (OSError, ssl.SSLError) as exc:
            logger.debug("data channel: a connection from the peer's address failed: %s", exc)
            return False
        return self._ticket_matches()

    def _flush(self) -> bool:
        """Send what TLS wrote; whether some is left for the socket's room."""
        out = self._outgoing.read()
        if out:
            self._unsent = out[self.sock.send(out) :]
        if self._unsent:
            self.events = selectors.EVENT_WRITE
            return True
        return False

    def channel(self) -> MemoryChannel:
        self.sock.setblocking(True)
        return MemoryChannel(self.sock, self._tls, self._incoming, self._outgoing)


_C = TypeVar("_C", bound=_Pending)
_Kind = Callable[[socket.socket, ssl.SSLContext, bytes], _C]


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An address as one value however it is written: an IPv4 client of a dual-stack
    socket (``::ffff:a.b.c.d``) is that IPv4 address; a zone (``%eth0``) is dropped."""
    try:
        address = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def dial(host: str, port: int, expected_key: bytes, ticket: bytes, stall_timeout: float) -> Channel:
    """Connect, run TLS, pin ``expected_key``, present ``ticket`` (blocking).

    Raises ``UnreachableError`` when no channel could be opened (the caller
    falls back to QUIC) and ``KeyMismatchError`` when another key answered.
    """
    try:
        conn = socket.create_connection((host, port), timeout=CONNECT_WAIT)
    except OSError as exc:
        raise UnreachableError(f"cannot open a data channel to {host}:{port}: {exc}") from None
    _prefer_bbr(conn)  # before a byte of TLS: the handshake gets it too
    try:
        tls = wrap_tls(client_context(), conn)
    except (OSError, ssl.SSLError) as exc:
        conn.close()
        raise UnreachableError(f"the data channel's TLS handshake failed: {exc}") from None
    channel = Channel(tls)
    try:
        check_pin(tls.getpeercert(binary_form=True), expected_key, f"{host}:{port}")
        tls.settimeout(stall_timeout)
        tls.sendall(ticket)
    except BaseException as exc:
        channel.close()
        if isinstance(exc, OSError):
            raise UnreachableError(f"the data channel to {host}:{port} failed: {exc}") from None
        raise
    return channel


def dial_memory(host: str, port: int, expected_key: bytes, ticket: bytes) -> MemoryChannel:
    """:func:`dial` for a desktop connection: the same TLS, run on memory buffers
    (:class:`MemoryChannel`); the socket is left blocking without a timeout."""
    try:
        conn = socket.create_connection((host, port), timeout=CONNECT_WAIT)
    except OSError as exc:
        raise UnreachableError(f"cannot open a data channel to {host}:{port}: {exc}") from None
    _prefer_bbr(conn)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = client_context().wrap_bio(incoming, outgoing)
    channel = MemoryChannel(conn, tls, incoming, outgoing)
    try:
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                conn.sendall(outgoing.read())
                data = conn.recv(65536)
                if not data:
                    raise UnreachableError(
                        f"the data channel's TLS handshake failed: {host}:{port} closed it"
                    ) from None
                incoming.write(data)
        check_pin(tls.getpeercert(binary_form=True), expected_key, f"{host}:{port}")
        tls.write(ticket)
        conn.sendall(outgoing.read())
        conn.settimeout(None)
    except BaseException as exc:
        channel.close()
        if isinstance(exc, ssl.SSLError):
            raise UnreachableError(f"the data channel's TLS handshake failed: {exc}") from None
        if isinstance(exc, OSError):
            raise UnreachableError(f"the data channel to {host}:{port} failed: {exc}") from None
        raise
    return channel


# --- pumping a file ---------------------------------------------------------------------------


class _Relay:
    """Full buffers from one thread to helper threads, and empty ones back.

    Each helper (hashing; writing) runs its ``work`` on every full buffer, in
    order, on its own thread; a buffer is reused once all of them are done
    with it. A failure in a helper is raised in the main thread at its next
    hand-off. Used as a context manager: leaving it waits until every buffer
    given is done, and raises a helper's failure unless the main thread is
    already raising (then the helpers finish what they were given: bytes that
    arrived are kept).
    """

    def __init__(
        self, works: list[Callable[[memoryview], object]], before: Callable[[], None]
    ) -> None:
        self._empty: queue.SimpleQueue[bytearray | None] = queue.SimpleQueue()
        self._made = 0  # buffers are made on first need: a small transfer makes one
        self._lock = threading.Lock()
        self._pending: dict[int, int] = {}
        self._error: BaseException | None = None
        self._queues: list[queue.SimpleQueue[tuple[bytearray, int] | None]] = []
        self._threads: list[threading.Thread] = []
        for index, work in enumerate(works):
            jobs: queue.SimpleQueue[tuple[bytearray, int] | None] = queue.SimpleQueue()
            first = before if index == 0 else None
            thread = threading.Thread(
                target=self._run, args=(work, jobs, first), name="gpumesh-channel", daemon=True
            )
            self._queues.append(jobs)
            self._threads.append(thread)
            thread.start()

    def _run(
        self,
        work: Callable[[memoryview], object],
        jobs: queue.SimpleQueue[tuple[bytearray, int] | None],
        before: Callable[[], None] | None,
    ) -> None:
        try:
            if before is not None:
                before()
            while (item := jobs.get()) is not None:
                buffer, length = item
                work(memoryview(buffer)[:length])
                with self._lock:
                    self._pending[id(buffer)] -= 1
                    free = self._pending[id(buffer)] == 0
                if free:
                    self._empty.put(buffer)
        except BaseException as exc:
            self._error = exc
            self._empty.put(None)  # wake the main thread

    def take(self) -> bytearray:
        if self._made < _PIECES and self._empty.empty():
            self._made += 1
            return bytearray(PIECE)
        buffer = self._empty.get()
        if buffer is None or self._error is not None:
            assert self._error is not None
            raise self._error
        return buffer

    def give(self, buffer: bytearray, length: int) -> None:
        with self._lock:
            self._pending[id(buffer)] = len(self._queues)
        for jobs in self._queues:
            jobs.put((buffer, length))

    def __enter__(self) -> _Relay:
        return self

    def __exit__(self, failed: type[BaseException] | None, *_: object) -> None:
        for jobs in self._queues:
            jobs.put(None)
        for thread in self._threads:
            thread.join()
        if failed is None and self._error is not None:
            raise self._error


def _recv_piece(
    channel: Channel, sock: socket.socket, buffer: bytearray, want: int, what: str
) -> int:
    """Fill ``buffer[:want]`` from ``sock`` (blocking); returns ``want``. A closed or
    broken connection raises ``ConnectionLostError`` naming ``what`` it was in."""
    view = memoryview(buffer)
    fill = 0
    while fill < want:
        try:
            got = sock.recv_into(view[fill:want])
        except OSError as exc:
            raise _lost(channel, exc) from None
        if not got:
            raise ConnectionLostError(f"the data channel closed in the middle of the {what}")
        fill += got
    return fill


def _lost(channel: Channel, exc: OSError) -> GPUMeshError:
    if isinstance(exc, TimeoutError):
        return ConnectionLostError("the data channel stalled (no progress for a while)")
    if channel.aborted:
        return ConnectionLostError("the data channel was closed")
    return ConnectionLostError(f"the data channel broke: {exc.strerror or exc}")


def send_file(
    channel: Channel,
    fd: int,
    offset: int,
    end: int,
    hasher: Hasher,
    progress: Callable[[int], None],
) -> None:
    """Send bytes ``offset..end`` of ``fd``; ``hasher`` gets ``0..end`` (blocking).

    The part before ``offset`` (already at the far end) is hashed from the
    file first, on the helper thread, while sending starts.
    """

    position = offset
    relay = _Relay([hasher.update], lambda: hash_file(fd, offset, hasher))
    with relay, channel.using() as sock:
        while position < end:
            buffer = relay.take()
            wanted = min(PIECE, end - position)
            view = memoryview(buffer)[:wanted]
            got = platform.preadv(fd, view, position)
            if got != wanted:
                raise ConfigError("the file shrank while it was being sent; copy it again")
            try:
                sock.sendall(view)
            except OSError as exc:
                raise _lost(channel, exc) from None
            relay.give(buffer, got)
            position += got
            progress(got)


def receive_file(
    channel: Channel,
    fd: int,
    count: int,
    hasher: Hasher,
    progress: Callable[[int], None],
    kept: int = 0,
) -> None:
    """Receive exactly ``count`` bytes, appending them to ``fd`` and hashing them (blocking).

    ``kept``: bytes already in the file before them (a resumed copy); they are
    hashed first, read back from the file on the hashing thread, while the
    first new pieces arrive. Never reads past ``count``: whatever else the peer
    sends stays unread. When the channel breaks, every whole piece received is
    in the file.
    """
    remaining = count
    # Writing and hashing on two threads: each costs about as much as the TLS.
    relay = _Relay(
        [hasher.update, partial(platform.write_all, fd)], lambda: hash_file(fd, kept, hasher)
    )
    with relay, channel.using() as sock:
        while remaining:
            buffer = relay.take()
            fill = _recv_piece(channel, sock, buffer, min(PIECE, remaining), "file")
            relay.give(buffer, fill)
            remaining -= fill
            progress(fill)


# --- pumping a stream of known size (a tar) ---------------------------------------------------


class _PieceWriter:
    """A write-only file that sends what is written in ``PIECE``-sized pieces, each
    hashed on the relay's thread after it went out; refuses a byte past ``size``."""

    def __init__(
        self,
        channel: Channel,
        sock: ssl.SSLSocket,
        relay: _Relay,
        size: int,
        progress: Callable[[int], None],
    ) -> None:
        self._channel = channel
        self._sock = sock
        self._relay = relay
        self._size = size
        self._progress = progress
        self._buffer: bytearray | None = None
        self._fill = 0
        self.sent = 0

    def write(self, data: bytes | bytearray | memoryview, /) -> int:
        view = memoryview(data).cast("B")
        if self.sent + self._fill + len(view) > self._size:
            raise ConfigError("the folder grew while it was packed; copy it again")
        while view:
            if self._buffer is None:
                self._buffer, self._fill = self._relay.take(), 0
            step = min(len(view), PIECE - self._fill)
            self._buffer[self._fill : self._fill + step] = view[:step]
            self._fill += step
            view = view[step:]
            if self._fill == PIECE:
                self._send()
        return len(data)

    def fill_from(self, fd: int, count: int) -> int:
        """Read bytes ``0..count`` of ``fd`` straight into the pieces (no copy between
        the file and TLS); returns how many there were (fewer: the file ended)."""
        if self.sent + self._fill + count > self._size:
            raise ConfigError("the folder grew while it was packed; copy it again")
        position = 0
        while position < count:
            if self._buffer is None:
                self._buffer, self._fill = self._relay.take(), 0
            step = min(count - position, PIECE - self._fill)
            got = platform.preadv(
                fd, memoryview(self._buffer)[self._fill : self._fill + step], position
            )
            if not got:
                break
            self._fill += got
            position += got
            if self._fill == PIECE:
                self._send()
        return position

    def flush(self) -> None:
        return None

    def close(self) -> None:
        """Send what is gathered (the last, partial piece)."""
        if self._buffer is not None and self._fill:
            self._send()

    def _send(self) -> None:
        assert self._buffer is not None
        buffer, fill = self._buffer, self._fill
        self._buffer, self._fill = None, 0
        try:
            self._sock.sendall(memoryview(buffer)[:fill])
        except OSError as exc:
            raise _lost(self._channel, exc) from None
        self._relay.give(buffer, fill)
        self.sent += fill
        self._progress(fill)


def send_stream(
    channel: Channel,
    size: int,
    produce: Callable[[_PieceWriter], object],
    hasher: Hasher,
    progress: Callable[[int], None],
) -> None:
    """Send exactly ``size`` bytes that ``produce`` writes into the file it is given
    (e.g. ``write_tar``), hashing them on a helper thread (blocking).

    Raises ``ConfigError`` when ``produce`` writes more or fewer bytes than ``size``
    (what it packs changed meanwhile): the far end then sees the channel close
    before the end, and keeps nothing.
    """
    relay = _Relay([hasher.update], lambda: None)
    with relay, channel.using() as sock:
        writer = _PieceWriter(channel, sock, relay, size, progress)
        produce(writer)
        writer.close()
        if writer.sent != size:
            raise ConfigError("the folder shrank while it was packed; copy it again")


def receive_stream(
    channel: Channel,
    count: int,
    consume: Callable[[Iterator[memoryview]], T],
    hasher: Hasher,
    progress: Callable[[int], None],
) -> T:
    """Receive exactly ``count`` bytes and hand them to ``consume`` (blocking).

    ``consume`` (e.g. an unpacker) runs on this thread and iterates over the
    bytes in pieces; a piece is valid only until it asks for the next one.
    Each piece is hashed on a helper thread once ``consume`` is done with it,
    so receiving and unpacking piece k+1 overlaps hashing piece k. Never reads
    past ``count``; ``consume`` must take every piece (a tar reader drains
    the padding after its last entry).
    """
    relay = _Relay([hasher.update], lambda: None)

    def pieces() -> Generator[memoryview, None, None]:
        remaining = count
        with channel.using() as sock:
            while remaining:
                buffer = relay.take()
                fill = _recv_piece(channel, sock, buffer, min(PIECE, remaining), "transfer")
                yield memoryview(buffer)[:fill]
                relay.give(buffer, fill)
                remaining -= fill
                progress(fill)

    with relay:
        stream = pieces()
        try:
            result = consume(stream)
            # Whatever the consumer left (nothing, when it read to the end) is checked here.
            for _rest in stream:
                raise ProtocolError("the receiver stopped before the end of the transfer")
        finally:
            stream.close()
    return result


def check_pin(der: bytes | None, expected_key: bytes, where: str) -> None:
    """Raise KeyMismatchError unless the certificate ``der`` holds ``expected_key``."""

    if not der:
        raise KeyMismatchError("the data channel presented no certificate")
    try:
        spki = x509.load_der_x509_certificate(der).public_key()
        raw = spki.public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    except ValueError:
        raise KeyMismatchError("the data channel presented an unreadable certificate") from None
    if not hmac.compare_digest(public_key_from_spki(raw), expected_key):
        raise KeyMismatchError(
            f"the data channel at {where} presented a different key than the peer"
        )
