"""Who owns the other end of a loopback TCP connection, from the kernel's socket table.

A listener on 127.0.0.1 is reachable by every account on the machine. Linux
lists each TCP socket of this network namespace, with the uid that made it, in
``/proc/net/tcp`` and ``/proc/net/tcp6``; the connecting socket is the row whose
local address is our peer's and whose remote address is ours. Elsewhere there is
no such table: :func:`owner_check_available` says so, and callers tell the user.

The table fails open if read naively: a socket whose process closed it (an
orphan, e.g. in FIN_WAIT2 after a connect-send-close) stays listed with uid 0
and inode 0, so it would pass for root's. Only a row that is ESTABLISHED or
CLOSE_WAIT and still has an inode (an open file of some process) proves an
owner; every other row proves nobody, and the connection is refused. This is
the one parser of the table: the desktop tunnel and the CUDA bridge both ask
:func:`connection_owner`.

:func:`parse_table` is the pure part (tested on captured tables);
:func:`socket_owner` reads the files.
"""

from __future__ import annotations

import ipaddress
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import socket

__all__ = [
    "connection_owner",
    "exposed_addresses",
    "listening_beyond_loopback",
    "listening_on_loopback",
    "owner_check_available",
    "parse_listeners",
    "parse_table",
    "socket_owner",
]

_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))

Endpoint = tuple[str, int]

_LISTEN = "0A"
"""TCP_LISTEN in the table's ``st`` column."""
_PROVES_OWNER = {"01", "08"}
"""TCP_ESTABLISHED and TCP_CLOSE_WAIT: the states in which a row is a live socket that a
process still holds; FIN_WAIT*, TIME_WAIT and the rest may be orphans listed as uid 0."""
_REACHES_LOOPBACK = {"127.0.0.1", "0.0.0.0", "::1", "::"}
"""Bound addresses a connection to 127.0.0.1 (or ::1) reaches."""


def owner_check_available() -> bool:
    """Whether this system lists socket owners (Linux with /proc mounted)."""
    return sys.platform.startswith("linux") and _TABLES[0].exists()


def _address(text: str) -> Endpoint:
    """``0100007F:1F90`` (host byte order per 32-bit word) -> ``("127.0.0.1", 8080)``."""
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(raw)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address), int(port, 16)


def _normal(endpoint: Endpoint) -> Endpoint:
    address = ipaddress.ip_address(endpoint[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address), endpoint[1]


def parse_table(text: str, local: Endpoint, remote: Endpoint) -> int | None:
    """The uid of the socket in ``text`` (a /proc/net/tcp table) bound to ``local``
    and connected to ``remote``; None when no row proves one: none matches, or the
    matching row is in another state than ESTABLISHED or CLOSE_WAIT or has inode 0
    (an orphan that no process holds, listed as uid 0)."""
    local, remote = _normal(local), _normal(remote)
    for line in text.splitlines()[1:]:
        # sl local rem st tx:rx tr:when retrnsmt uid timeout inode ...
        fields = line.split()
        if len(fields) < 10:
            continue
        try:
            if _address(fields[1]) != local or _address(fields[2]) != remote:
                continue
            if fields[3] not in _PROVES_OWNER or int(fields[9]) == 0:
                return None
            return int(fields[7])
        except ValueError:
            continue
    return None


def socket_owner(local: Endpoint, remote: Endpoint) -> int | None:
    """The uid that owns the TCP socket bound to ``local`` and connected to ``remote``
    (None: not found, or no table to look in)."""
    for table in _TABLES:
        try:
            text = table.read_text()
        except OSError:
            continue
        uid = parse_table(text, local, remote)
        if uid is not None:
            return uid
    return None


def connection_owner(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of ``sock``, a TCP connection accepted on
    loopback; None when the table proves no owner (or there is no table): refuse it."""
    ours, theirs = sock.getsockname()[:2], sock.getpeername()[:2]
    return socket_owner((str(theirs[0]), int(theirs[1])), (str(ours[0]), int(ours[1])))


def parse_listeners(text: str) -> set[Endpoint]:
    """The addresses TCP sockets listen on in ``text`` (a /proc/net/tcp table)."""
    found = set()
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 4 or fields[3] != _LISTEN:
            continue
        try:
            found.add(_address(fields[1]))
        except ValueError:
            continue
    return found


def listening_on_loopback(port: int) -> bool | None:
    """Whether a TCP server on this host takes connections to 127.0.0.1:``port``, read
    from the kernel's table without connecting (a VNC server started for one client
    would take a test connection as its one and exit); None where there is no table."""
    listeners = _listeners()
    if listeners is None:
        return None
    return any(p == port and host in _REACHES_LOOPBACK for host, p in listeners)


def exposed_addresses(listeners: set[Endpoint], port: int) -> list[str]:
    """The addresses beyond loopback that listeners on ``port`` are bound to
    (``0.0.0.0`` and ``::`` included: every address of the machine), sorted."""
    hosts = (host for host, bound in listeners if bound == port)  # one port: each host once
    return sorted(host for host in hosts if not ipaddress.ip_address(host).is_loopback)


def listening_beyond_loopback(port: int) -> list[str] | None:
    """Where a TCP server on ``port`` takes connections from more than this machine's
    loopback (its containers through their gateway, the LAN): the bound addresses,
    empty when none; None where there is no table to read."""
    listeners = _listeners()
    return None if listeners is None else exposed_addresses(listeners, port)


def _listeners() -> set[Endpoint] | None:
    """Every address a TCP socket of this host listens on (IPv4 and IPv6 tables);
    None where there is no table to read."""
    if not owner_check_available():
        return None
    listeners: set[Endpoint] = set()
    for table in _TABLES:
        try:
            listeners |= parse_listeners(table.read_text())
        except OSError:
            continue
    return listeners
