"""The owner's view of a providing node (the control API's ``/owner``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from gpumesh.client.views.joblist import JobListEntry

if TYPE_CHECKING:
    from gpumesh.client.owner import EndedSession, OpenSessions, OwnerView
    from gpumesh.store.home import Relaying

__all__ = [
    "CudaSessionView",
    "CudaShareView",
    "DesktopSessionView",
    "DesktopShareView",
    "EndedSessionView",
    "OwnerStatusView",
    "RelayedSessionView",
    "RelayingView",
    "SessionsView",
    "ShellSessionView",
]


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


class ShellSessionView(msgspec.Struct):
    """An open shell: a peer's program in a fresh container here."""

    id: str
    """What ends it: ``POST /api/v1/owner/shells/{id}/stop``."""
    peer: str
    image: str
    container: str
    """The container's name."""
    since: float
    """Unix time it opened."""


class DesktopSessionView(msgspec.Struct):
    """An open connection of a peer to this machine's shared desktop."""

    id: str
    """What ends it: ``POST /api/v1/owner/desktop/{id}/stop``."""
    peer: str
    kind: str
    """``vnc``, ``rdp`` or ``tcp``."""
    port: int
    """The local port the owner shared."""
    since: float


class CudaSessionView(msgspec.Struct):
    """An open CUDA session of a peer: a worker process holding GPU (or host) memory."""

    id: str
    """What ends it: ``POST /api/v1/owner/cuda/{id}/stop``."""
    peer: str
    memory: int
    """Bytes held for it."""
    backend: str
    """``driver`` or ``fallback`` (host memory)."""
    device: str
    gpus: list[str]
    since: float
    pid: int
    """The worker process."""


class SessionsView(msgspec.Struct):
    """The sharing agent's open sessions."""

    shells: list[ShellSessionView]
    desktops: list[DesktopSessionView]
    cuda: list[CudaSessionView]

    @classmethod
    def of(cls, sessions: OpenSessions) -> SessionsView:
        return cls(
            shells=[
                ShellSessionView(s["id"], s["peer"], s["image"], s["container"], _float(s["since"]))
                for s in sessions.shells
            ],
            desktops=[
                DesktopSessionView(
                    d["id"],
                    d["peer"],
                    d["kind"],
                    int(d["port"]) if d["port"].isdigit() else 0,
                    _float(d["since"]),
                )
                for d in sessions.desktops
            ],
            cuda=[
                CudaSessionView(
                    c.id, c.peer, c.memory, c.backend, c.device, list(c.gpus), c.started, c.pid
                )
                for c in sessions.cuda
            ],
        )


class RelayedSessionView(msgspec.Struct):
    """A session this node relays between two of its peers."""

    a: str
    """The peer that asked for it."""
    b: str
    """The peer it reaches."""
    bytes: int
    """Bytes relayed both ways so far."""
    age: float
    """Seconds since it was asked for."""
    state: str
    """``pending`` or ``active``."""


class RelayingView(msgspec.Struct):
    """This node relaying for its peers (``relay_for_peers``): who, and how much."""

    sessions: list[RelayedSessionView]
    registered: list[str]
    """Peers registered with it now: its other peers reach them through it."""
    max_sessions: int
    """``relay_for_peers_sessions``."""
    rate: int
    """``relay_for_peers_rate`` in bytes a second, for all sessions together."""
    bytes_relayed: int
    """Since sharing started."""
    refusals: dict[str, int]
    """Refusal code -> count (``relay-full``, ``pair-not-allowed``, ``not-allowed``...)."""

    @classmethod
    def of(cls, relaying: Relaying | None) -> RelayingView | None:
        if relaying is None:
            return None
        return cls(
            sessions=[
                RelayedSessionView(s.a, s.b, s.bytes, s.age, s.state) for s in relaying.sessions
            ],
            registered=list(relaying.registered),
            max_sessions=relaying.max_sessions,
            rate=relaying.rate,
            bytes_relayed=relaying.bytes_relayed,
            refusals=dict(relaying.refusals),
        )


class OwnerStatusView(msgspec.Struct):
    """Who uses this machine now."""

    sharing: bool
    agent_pid: int | None
    connections: list[dict[str, str]]
    """The agent's connected peers: ``{"peer": name, "path": "direct"}``."""
    running: int
    """Jobs run here for peers that have not ended."""
    hosted: list[JobListEntry]
    """The newest jobs run here for peers, newest first."""
    sessions: SessionsView
    """Open shells, desktop connections and CUDA sessions."""
    relaying: RelayingView | None = None
    """What this node relays for its peers; null unless ``relay_for_peers`` is on."""

    @classmethod
    def of(cls, view: OwnerView) -> OwnerStatusView:
        agent = view.agent
        return cls(
            sharing=agent is not None,
            agent_pid=agent.pid if agent else None,
            connections=agent.links if agent else [],
            running=len(view.running),
            hosted=[JobListEntry.of(j, {}) for j in view.hosted],
            sessions=SessionsView.of(view.sessions),
            relaying=RelayingView.of(agent.relaying if agent else None),
        )


class EndedSessionView(msgspec.Struct):
    """A session the owner ended."""

    kind: str
    """``shell``, ``desktop`` or ``cuda``."""
    id: str
    peer: str

    @classmethod
    def of(cls, ended: EndedSession) -> EndedSessionView:
        return cls(str(ended.kind), ended.id, ended.peer)


class DesktopShareView(msgspec.Struct):
    """The desktop this node offers (``/api/v1/desktop/share``)."""

    shared: bool
    """False: not offered (or, after ``DELETE``, was not)."""
    kind: str | None = None
    port: int | None = None
    sharing: bool = False
    """Whether this node shares now (the desktop is offered only while it does)."""


class CudaShareView(msgspec.Struct):
    """Whether this node offers CUDA sessions (``/api/v1/cuda/share``)."""

    offered: bool
    sharing: bool = False
    """Whether this node shares now (sessions are offered only while it does)."""
