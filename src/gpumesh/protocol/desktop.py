"""What a desktop share is: its kinds, their usual ports, and what a user runs.

Shared by the provider (which port it forwards to), the consumer (which loopback
port it listens on, what it tells the user to run) and the CLI. No I/O here.
"""

from __future__ import annotations

import enum

__all__ = ["DesktopKind", "client_commands", "kind_for_port"]


class DesktopKind(enum.StrEnum):
    """The kind of desktop server an owner shares."""

    VNC = "vnc"
    RDP = "rdp"
    TCP = "tcp"
    """A port the owner named (``--port``) that is not a usual VNC or RDP one."""

    @property
    def server_port(self) -> int:
        """The port such a server usually listens on (0: none)."""
        return _SERVER_PORTS.get(self, 0)

    @property
    def local_port(self) -> int:
        """The loopback port ``desktop connect`` listens on by default."""
        return _LOCAL_PORTS[self]

    @classmethod
    def parse(cls, text: str) -> DesktopKind:
        """A kind a peer named; one this version does not know is treated as plain TCP."""
        try:
            return cls(text)
        except ValueError:
            return cls.TCP


_SERVER_PORTS = {DesktopKind.VNC: 5900, DesktopKind.RDP: 3389}
_LOCAL_PORTS = {DesktopKind.VNC: 15900, DesktopKind.RDP: 13389, DesktopKind.TCP: 15900}


def kind_for_port(port: int) -> DesktopKind:
    """What a port the owner named most likely serves: VNC's 5900-5999 (displays),
    RDP's 3389, else plain TCP."""
    if 5900 <= port <= 5999:
        return DesktopKind.VNC
    if port == 3389:
        return DesktopKind.RDP
    return DesktopKind.TCP


def client_commands(kind: DesktopKind, host: str, port: int) -> list[str]:
    """What to run to use a tunnel listening on ``host:port``."""
    if kind is DesktopKind.VNC:
        # vncviewer's HOST::PORT is a TCP port; HOST:N would be display N (5900+N).
        return [f"vncviewer {host}::{port}"]
    if kind is DesktopKind.RDP:
        return [f"xfreerdp /v:{host}:{port}", f"mstsc /v:{host}:{port}"]
    return [f"connect your client to {host}:{port}"]
