"""The shapes of ``gpumesh desktop`` (``doctor`` and ``connect``) and of a CUDA bridge:
what a loopback listener of the node process says while it serves."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from gpumesh.client.desktop import DesktopReport, TunnelReady

__all__ = [
    "TUNNEL_EVENTS",
    "CudaBridgeView",
    "DesktopDoctorView",
    "LocalServerView",
    "TunnelConnectionView",
    "TunnelRefusedView",
    "TunnelView",
    "TunnelWarningView",
]


class LocalServerView(msgspec.Struct):
    """A desktop server listening on 127.0.0.1."""

    kind: str
    """``vnc``, ``rdp`` or ``tcp``."""
    port: int
    greeting: str | None
    exposed: list[str] = []
    """Addresses beyond loopback it also listens on (``0.0.0.0``: every one): reachable
    without GPUMesh, by jobs in containers and the LAN."""


class DesktopDoctorView(msgspec.Struct):
    """``desktop doctor``: local servers, the share, who may use it, who is connected."""

    servers: list[LocalServerView]
    shared: bool
    share_kind: str | None
    share_port: int | None
    share_answers: bool
    """Whether a server listens on the shared port now."""
    sharing: bool
    """Whether `gpumesh share` runs (the desktop is offered only while it does)."""
    allowed: list[str]
    """Peers on the desktop allowlist (names)."""
    connected: list[dict[str, str]]
    """Open desktop connections: ``{"peer", "kind", "since"}``."""
    owner_checked: bool
    """Whether `desktop connect` here refuses other local users' connections."""

    @classmethod
    def of(cls, report: DesktopReport) -> DesktopDoctorView:
        share = report.share
        return cls(
            servers=[
                LocalServerView(str(s.kind), s.port, s.greeting or None, list(s.exposed))
                for s in report.servers
            ],
            shared=share is not None,
            share_kind=str(share.kind) if share else None,
            share_port=share.port if share else None,
            share_answers=report.share_answers,
            sharing=report.sharing,
            allowed=[peer.name for peer in report.allowed],
            connected=report.connected,
            owner_checked=report.owner_checked,
        )


class TunnelView(msgspec.Struct):
    """``desktop connect --json``: printed once the tunnel listens."""

    provider: str
    kind: str
    listen: str
    """``host:port`` of the loopback listener."""
    commands: list[str]
    owner_checked: bool

    @classmethod
    def of(cls, ready: TunnelReady) -> TunnelView:
        host = f"[{ready.host}]" if ":" in ready.host else ready.host
        return cls(
            provider=ready.offer.provider,
            kind=str(ready.offer.kind),
            listen=f"{host}:{ready.port}",
            commands=ready.commands,
            owner_checked=ready.owner_checked,
        )


class TunnelConnectionView(msgspec.Struct):
    """``desktop connect --json``: one line for each local connection, once it is open."""

    connection: int
    """Its number in this tunnel, from 1."""
    path: str
    """What carries its bytes: ``channel`` (a data channel of its own, TLS on TCP)
    or ``quic`` (its stream of the session)."""


class TunnelRefusedView(msgspec.Struct):
    """A local connection the tunnel refused: another user's process made it."""

    uid: int | None
    """That user's id (None: not known)."""


class TunnelWarningView(msgspec.Struct):
    """A connection the provider refused while the tunnel goes on."""

    message: str


class CudaBridgeView(msgspec.Struct):
    """``cuda bridge``: where programs here reach the session (``RemoteDevice.bridge``)."""

    where: str
    """``HOST:PORT`` or ``unix:PATH``."""


TUNNEL_EVENTS: dict[str, type] = {
    cls.__name__.lower(): cls
    for cls in (TunnelView, TunnelConnectionView, TunnelRefusedView, TunnelWarningView)
}
"""A desktop tunnel's Server-Sent Events (``POST /api/v1/desktop/connect``), named as the
control API names them: the struct's name."""
