"""What the node process's own routes answer: the process, and a shell's offer.

The node process (:mod:`gpumesh.daemon`) fills these in and serves them through
the control API; the routes' table and the OpenAPI document name them here, so
the API needs nothing of the process but what ``ControlState`` hands it. Its
share's views are :mod:`gpumesh.control.shareviews`. Imports only msgspec: the
thin CLI reads the process's view.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "DaemonStatusView",
    "NodeProcessView",
    "NodeVersionView",
    "OutgoingView",
    "RelayRegistrationView",
    "ShareEndedView",
    "ShellOfferView",
    "WarmSessionView",
]


class ShareEndedView(msgspec.Struct):
    """When and how this home's last share ended."""

    at: float
    how: str


class WarmSessionView(msgspec.Struct):
    """A session to a peer the node process keeps open for the next request."""

    peer: str
    path: str
    """``lan``, ``direct``, ``direct (hole-punched) ADDR`` or ``relayed via RELAY``."""
    idle: float
    """Seconds since it was last used."""
    uses: int
    """Requests it carried (a job's submission and its follow are two)."""
    local_port: int | None = None
    """The local UDP port its packets leave from (the shared socket's, for IPv4 peers)."""


class RelayRegistrationView(msgspec.Struct):
    """The shared socket's registration with one relay."""

    relay: str
    state: str
    """``registered as ADDR`` (as the relay sees this node), ``registering`` or
    ``refused: ...``."""
    registrations: int
    """Times the relay accepted it (more than 1: it was lost and made again)."""


class OutgoingView(msgspec.Struct):
    """The one UDP socket every outgoing link of the node process leaves from."""

    port: int | None
    """Its local UDP port; None until the first dial opens it."""
    links: int
    """QUIC links open on it."""
    relays: list[RelayRegistrationView]


class NodeProcessView(msgspec.Struct):
    """This home's node process."""

    pid: int
    version: str
    started_at: float
    detached: bool
    """Started in the background by a command (restarted by a command of another
    version); False: in the foreground (``gpumesh-control``)."""
    sharing: bool
    """This process shares this machine (``gpumesh share`` asked it to)."""
    api: list[str]
    """Where its control API listens: the unix socket's path, then ``http://host:port``."""
    idle_exit: float | None
    """Seconds without a request after which it exits; None: it stays."""
    warm_sessions: list[WarmSessionView]
    outgoing: OutgoingView | None = None
    """The shared dialling socket and its relay registrations."""
    share_ended: ShareEndedView | None = None
    """While it does not share: when and how the home's last share ended."""


class ShellOfferView(msgspec.Struct):
    """Where to connect for the shell's bytes: ``socket`` (a unix socket's path) or,
    without unix sockets, loopback TCP ``port``; send ``token`` first."""

    socket: str
    port: int
    token: str


class DaemonStatusView(msgspec.Struct):
    """``gpumesh daemon status --json``: whether a node process runs, and it."""

    running: bool
    node: NodeProcessView | None


class NodeVersionView(msgspec.Struct):
    """What a command reads of ``GET /api/v1/node`` from a node process of another
    version (whose view may have other fields): enough to replace it or say why not."""

    version: str = ""
    pid: int = 0
    detached: bool = False
    sharing: bool = False
