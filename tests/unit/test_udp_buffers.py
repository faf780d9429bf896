"""A QUIC socket's receive buffer: 16 MiB where the system's cap allows, and past
the cap where the process may (on Linux, with CAP_NET_ADMIN), so a burst
that arrives while the process waits for a CPU is not dropped. Real sockets."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from gpumesh.transport.udp import open_udp_socket

MIB = 1024 * 1024


def _cap() -> int:
    path = Path("/proc/sys/net/core/rmem_max")
    return int(path.read_text()) if path.exists() else 4 * MIB


def _net_admin() -> bool:
    """Whether this process has CAP_NET_ADMIN (bit 12 of its effective capabilities)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 12 & 1)
    return False


def test_the_receive_buffer_is_as_large_as_allowed() -> None:
    sock = open_udp_socket("127.0.0.1", 0)
    try:
        got = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    finally:
        sock.close()
    if sys.platform != "linux":
        assert got > 0
        return
    # Linux doubles what it grants (for its own bookkeeping).
    assert got >= 2 * min(16 * MIB, _cap())
    if _net_admin():
        assert got >= 2 * 16 * MIB  # forced past the cap
