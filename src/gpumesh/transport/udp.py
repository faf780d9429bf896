"""A non-blocking UDP socket that moves datagrams in batches.

Python has no ``recvmmsg``/``sendmmsg``, so per-datagram syscalls dominate a
naive QUIC loop. On Linux we use generic segmentation offload instead: one
``sendmsg`` with ``UDP_SEGMENT`` hands the kernel up to 64 equal-size
datagrams, and ``UDP_GRO`` lets one ``recvmsg`` return many coalesced ones.
Where the kernel lacks either (macOS, Windows, old kernels), the same
interface falls back to one syscall per datagram; where Python lacks
``sendmsg``/``recvmsg`` (Windows) it uses ``sendto``/``recvfrom`` only. Which of
them this machine has is asked of :mod:`gpumesh.platform`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import struct
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

# Address and its text forms are defined in the protocol layer; re-exported here
# for the callers that open sockets with them.
from gpumesh import platform
from gpumesh.protocol.addresses import Address, format_address, parse_address

__all__ = [
    "GSO_MAX_BYTES",
    "GSO_MAX_SEGMENTS",
    "Address",
    "Received",
    "UdpSocket",
    "format_address",
    "gso_control",
    "gso_runs",
    "open_udp_socket",
    "parse_address",
]

logger = logging.getLogger(__name__)

# Linux values; the socket module does not export them on every Python.
_SOL_UDP = 17
_UDP_SEGMENT = 103
_UDP_GRO = 104
GSO_MAX_SEGMENTS = 64
GSO_MAX_BYTES = 65000
"""A run sent with one write: the kernel's limits for UDP segmentation offload."""
_RECV_BUFFER = 65535
_SOCKET_BUFFER = 4 * 1024 * 1024
_RECEIVE_BUFFER = 16 * 1024 * 1024
"""The receive buffer asked for: up to the system's cap (``net.core.rmem_max``), and
past it where the process may (``CAP_NET_ADMIN``). A bulk sender's burst that arrives
while this process waits for a CPU is dropped whole when the buffer is full (measured on
a loaded machine: 1-2% of a transfer's datagrams with a cap of 4 MiB)."""
_SO_RCVBUFFORCE = 33
_CMSG_SPACE = socket.CMSG_SPACE(4) if hasattr(socket, "CMSG_SPACE") else 0
_IP_RECVERR = getattr(socket, "IP_RECVERR", 11)
_ICMP_ERRORS = frozenset(
    {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.EPROTO}
)
"""What a socket with ``IP_RECVERR`` reports once, on its next call, for an ICMP error."""
_ERR_CMSG_SPACE = socket.CMSG_SPACE(64) if hasattr(socket, "CMSG_SPACE") else 0


def gso_control(segment: int) -> list[tuple[int, int, bytes]]:
    """The ``sendmsg`` ancillary data that cuts one buffer into ``segment``-byte datagrams."""
    return [(_SOL_UDP, _UDP_SEGMENT, struct.pack("=H", segment))]


def gso_runs(
    datagrams: Iterable[tuple[bytes, Address]],
) -> Iterator[tuple[list[bytes], int, Address]]:
    """``(run, size, address)``: consecutive datagrams of one size to one address (the
    last of a run may be shorter), as many as one GSO write takes; any other alone."""
    run: list[bytes] = []
    run_to: Address = ("", 0)
    size = 0
    for data, address in datagrams:
        if (
            run
            and address == run_to
            and len(data) <= size
            and len(run) < GSO_MAX_SEGMENTS
            and (len(run) + 1) * size <= GSO_MAX_BYTES
        ):
            run.append(data)
            if len(data) < size:  # a shorter datagram must end a GSO run
                yield run, size, run_to
                run = []
            continue
        if run:
            yield run, size, run_to
        run, run_to, size = [data], address, len(data)
    if run:
        yield run, size, run_to


@dataclass(frozen=True, slots=True)
class Received:
    """One ``recvmsg`` result: ``data`` holds datagrams of ``segment_size`` bytes
    each (the last may be shorter); without GRO, ``segment_size == len(data)``."""

    data: bytes
    segment_size: int
    address: Address


def open_udp_socket(host: str, port: int, *, dual_stack: bool = False) -> socket.socket:
    """Bind a UDP socket for QUIC, with buffers big enough to avoid drops.

    ``dual_stack``: an IPv6 socket also serves IPv4 where the OS allows it.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.setblocking(False)
        if dual_stack and family == socket.AF_INET6:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        for opt, size in ((socket.SO_RCVBUF, _RECEIVE_BUFFER), (socket.SO_SNDBUF, _SOCKET_BUFFER)):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, opt, size)
        if sys.platform == "linux":
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, _RECEIVE_BUFFER)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class UdpSocket:
    """Batched datagram I/O over one bound, non-blocking UDP socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.gso = False
        self.gro = False
        batched = platform.has("sendmsg")
        if platform.has("gso") and batched:
            with contextlib.suppress(OSError):
                sock.getsockopt(_SOL_UDP, _UDP_SEGMENT)
                self.gso = True
        if platform.has("gro") and batched:
            with contextlib.suppress(OSError):
                sock.setsockopt(_SOL_UDP, _UDP_GRO, 1)
                self.gro = True
        self._pending: deque[tuple[bytes, int, Address | None]] = deque()
        self.peer: Address | None = None
        self.reports_refusals = False
        """ICMP errors of this unconnected socket are queued (:meth:`report_refusals`)."""
        logger.debug("udp socket %s gso=%s gro=%s", sock.getsockname(), self.gso, self.gro)

    @property
    def local_address(self) -> Address:
        name = self.sock.getsockname()
        return (name[0], name[1])

    def connect(self, address: Address) -> None:
        """Fix the peer, so an ICMP 'port unreachable' surfaces as an error."""
        self.sock.connect(address)
        self.peer = address

    def report_refusals(self) -> None:
        """Queue ICMP errors of this unconnected IPv4 socket (Linux's ``IP_RECVERR``),
        so a dial from a shared socket to a port where nothing listens fails at once
        (:meth:`take_refusals` names those ports); elsewhere nothing changes."""
        if self.sock.family != socket.AF_INET or not hasattr(socket, "MSG_ERRQUEUE"):
            return
        try:
            self.sock.setsockopt(socket.IPPROTO_IP, _IP_RECVERR, 1)
        except OSError:
            return
        self.reports_refusals = True

    def take_refusals(self) -> list[Address]:
        """Empty the ICMP error queue; the destinations that said nothing listens there."""
        refused: list[Address] = []
        for _ in range(256):
            try:
                _data, ancdata, _flags, addr = self.sock.recvmsg(
                    1, _ERR_CMSG_SPACE, socket.MSG_ERRQUEUE
                )
            except OSError:  # the queue is empty (EAGAIN), or no queue at all
                break
            for level, kind, value in ancdata:
                is_error = level == socket.IPPROTO_IP and kind == _IP_RECVERR and len(value) >= 4
                if is_error and addr and struct.unpack_from("=I", value)[0] == errno.ECONNREFUSED:
                    refused.append((addr[0], addr[1]))
        return refused

    # --- receive ----------------------------------------------------------------

    def receive_batch(self, limit: int = 512) -> list[Received]:
        """Read what is queued now (at most ``limit`` syscalls); never blocks.

        Raises ``ConnectionRefusedError`` on a connected socket whose peer
        answered with ICMP port unreachable.
        """
        batch: list[Received] = []
        sock = self.sock
        for _ in range(limit):
            try:
                if self.gro:
                    data, ancdata, _flags, addr = sock.recvmsg(_RECV_BUFFER, _CMSG_SPACE)
                    segment = len(data)
                    for level, kind, value in ancdata:
                        if level == _SOL_UDP and kind == _UDP_GRO:
                            segment = struct.unpack("=i", value[:4])[0]
                else:
                    data, addr = sock.recvfrom(_RECV_BUFFER)
                    segment = len(data)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                if not self.reports_refusals:
                    raise
                continue  # an ICMP error, reported once here: take_refusals names it
            if data:
                batch.append(Received(data, segment or len(data), (addr[0], addr[1])))
        return batch

    # --- send -------------------------------------------------------------------

    @property
    def blocked(self) -> bool:
        """Whether earlier datagrams still wait for the socket to drain."""
        return bool(self._pending)

    def send_batch(self, datagrams: Iterable[tuple[bytes, Address]]) -> None:
        """Queue datagrams and send as many as the socket takes now.

        Runs of equal-size datagrams to one address go out as one GSO send.
        """
        pending = self._pending
        if self.gso:
            for run, size, address in gso_runs(datagrams):
                pending.append((b"".join(run), size, address))
        else:
            for data, addr in datagrams:
                pending.append((data, len(data), addr))
        self.flush()

    def flush(self) -> bool:
        """Send queued datagrams; return True when the queue is empty."""
        pending = self._pending
        sock = self.sock
        connected = self.peer is not None
        retried = False
        while pending:
            data, segment, addr = pending[0]
            try:
                if len(data) > segment:
                    cmsg = gso_control(segment)
                    if connected:
                        sock.sendmsg([data], cmsg)
                    else:
                        sock.sendmsg([data], cmsg, 0, addr)
                elif connected:
                    sock.send(data)
                else:
                    assert addr is not None
                    sock.sendto(data, addr)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as exc:
                if exc.errno == errno.EIO and len(data) > segment:
                    # The device refused segmentation offload: send one by one from now on.
                    self.gso = False
                    pending.popleft()
                    for offset in reversed(range(0, len(data), segment)):
                        pending.appendleft((data[offset : offset + segment], segment, addr))
                    continue
                if self.reports_refusals and not retried and exc.errno in _ICMP_ERRORS:
                    # An ICMP error about an earlier datagram to anywhere, which the
                    # kernel reports on this send: the datagram itself did not go.
                    retried = True
                    continue
                # Unreachable peers and similar: drop the datagram like the network would.
                logger.debug("udp send to %s failed: %s", addr, exc)
            pending.popleft()
            retried = False
        return True

    def close(self) -> None:
        self._pending.clear()
        self.sock.close()
