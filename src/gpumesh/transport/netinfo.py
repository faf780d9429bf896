"""Which addresses this machine can be reached at, for pairing-code hints."""

from __future__ import annotations

import contextlib
import socket
import struct

from gpumesh import platform

__all__ = ["local_addresses", "multicast_interfaces", "own_ipv4s"]

_SIOCGIFADDR = 0x8915
_SKIP_PREFIXES = ("docker", "veth", "br-", "virbr", "cni", "flannel")


def _interface_ipv4s(*, every: bool = False) -> list[str]:
    """The IPv4 address of each interface (``every``: those of containers too)."""
    # SIOCGIFADDR is Linux's number; elsewhere the primary address is the hint.
    if platform.system() != "linux" or not platform.has("fcntl"):
        return []
    import fcntl

    found: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _index, name in socket.if_nameindex():
            if name.startswith(_SKIP_PREFIXES) and not every:
                continue
            with contextlib.suppress(OSError):
                packed = struct.pack("256s", name[:15].encode())
                result = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, packed)
                found.append(socket.inet_ntoa(result[20:24]))
    return found


def own_ipv4s() -> set[str]:
    """This machine's IPv4 addresses (in this network namespace): a LAN announcement
    from one of them comes from another home here, never from a LAN peer."""
    found = set(_interface_ipv4s(every=True))
    primary = _primary_ipv4()
    if primary:
        found.add(primary)
    return found


def multicast_interfaces() -> list[int]:
    """Indexes of the interfaces LAN announcements go out on: all but loopback and
    those of containers and virtual machines (empty where the system cannot list them)."""
    try:
        names = socket.if_nameindex()
    except OSError:
        return []
    return [index for index, name in names if name != "lo" and not name.startswith(_SKIP_PREFIXES)]


def _primary_ipv4() -> str | None:
    # Connecting a UDP socket sends nothing; it only asks the kernel for a route.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address: str = sock.getsockname()[0]
        return address


def local_addresses(listen_host: str, port: int) -> list[str]:
    """``host:port`` hints, best first: the primary address, others, loopback last."""
    if listen_host not in ("0.0.0.0", "::"):
        return [f"[{listen_host}]:{port}" if ":" in listen_host else f"{listen_host}:{port}"]
    hosts: list[str] = []
    primary = _primary_ipv4()
    if primary:
        hosts.append(primary)
    for address in _interface_ipv4s():
        if address not in hosts and not address.startswith("127."):
            hosts.append(address)
    hosts.append("127.0.0.1")
    return [f"{host}:{port}" for host in hosts]
