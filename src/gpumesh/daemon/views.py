"""The node process as the control API and ``gpumesh daemon status --json`` show it."""

from __future__ import annotations

import msgspec

__all__ = ["NodeProcessView", "WarmSessionView"]


class WarmSessionView(msgspec.Struct):
    """A session to a peer the node process keeps open for the next request."""

    peer: str
    path: str
    """``direct``, ``direct (hole-punched) ADDR`` or ``relayed via RELAY``."""
    idle: float
    """Seconds since it was last used."""
    uses: int
    """Requests it carried (a job's submission and its follow are two)."""


class NodeProcessView(msgspec.Struct):
    """This home's node process."""

    pid: int
    version: str
    started_at: float
    detached: bool
    """Started in the background by a command (restarted by a command of another
    version); False: in the foreground (``gpumesh-control``)."""
    sharing: bool
    """This home shares (``gpumesh share`` runs)."""
    api: list[str]
    """Where its control API listens: the unix socket's path, then ``http://host:port``."""
    idle_exit: float | None
    """Seconds without a request after which it exits; None: it stays."""
    warm_sessions: list[WarmSessionView]
