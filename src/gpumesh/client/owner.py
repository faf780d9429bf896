"""The owner's view of a providing node: who is connected and what runs here for peers.

Read from this home's store and what the running agent says of itself
(:meth:`Home.agent_info`); no network. The owner ends one open session (a shell,
a desktop connection, a CUDA session) through the running agent, which owns
them: :func:`end_session` asks it, in the node process that runs it, and waits
until it no longer lists the session.

:func:`worker_user` is the line ``cuda share``, ``cuda doctor`` and ``doctor``
print when CUDA workers cannot run as ``job_user`` (the agent is not root).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpumesh.errors import AgentError, NotFoundError
from gpumesh.protocol.states import FINAL_STATES, JobRole

if TYPE_CHECKING:
    from gpumesh.client.node import Node
    from gpumesh.store.home import AgentInfo, Home
    from gpumesh.store.jobs import JobRecord

__all__ = [
    "END_TIMEOUT",
    "OpenSessions",
    "OwnerSession",
    "OwnerView",
    "SessionKind",
    "end_session",
    "open_sessions",
    "owner_view",
    "sessions_of",
    "worker_user",
    "worker_user_note",
]

_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
"""What the agent's session ids look like."""
END_TIMEOUT = 10.0
"""How long ending a session waits for the agent to say it ended."""


class SessionKind(enum.StrEnum):
    """What the owner can end one of."""

    SHELL = "shell"
    DESKTOP = "desktop"
    CUDA = "cuda"


@dataclass(frozen=True)
class OwnerSession:
    """One open CUDA session, as the running agent says it."""

    peer: str
    memory: int
    backend: str
    device: str
    gpus: list[str]
    started: float
    pid: int
    id: str = ""
    """How the owner names it to end it."""


@dataclass(frozen=True)
class OpenSessions:
    """The running agent's open sessions (none when no agent runs)."""

    shells: list[dict[str, str]] = field(default_factory=list)
    """``{"id", "peer", "image", "container", "since"}``, as the agent says them."""
    desktops: list[dict[str, str]] = field(default_factory=list)
    """``{"id", "peer", "kind", "port", "since"}``."""
    cuda: list[OwnerSession] = field(default_factory=list)

    def find(self, kind: SessionKind, session_id: str) -> str | None:
        """The peer of the open session ``session_id`` of ``kind``, or None."""
        if kind is SessionKind.CUDA:
            return next((s.peer for s in self.cuda if s.id == session_id), None)
        entries = self.shells if kind is SessionKind.SHELL else self.desktops
        return next((e["peer"] for e in entries if e.get("id") == session_id), None)


def open_sessions(agent: AgentInfo | None) -> OpenSessions:
    """What ``agent`` (this home's running agent, or None) says of its sessions."""
    if agent is None:
        return OpenSessions()
    return OpenSessions(list(agent.shells), list(agent.desktop), sessions_of(agent))


def sessions_of(agent: AgentInfo) -> list[OwnerSession]:
    """The CUDA sessions ``agent`` says it has open."""
    found = []
    for item in agent.cuda:
        try:
            found.append(
                OwnerSession(
                    peer=str(item["peer"]),
                    memory=int(item["memory"]),
                    backend=str(item["backend"]),
                    device=str(item["device"]),
                    gpus=[str(g) for g in item.get("gpus", [])],
                    started=float(item["started"]),
                    pid=int(item["pid"]),
                    id=str(item.get("id", "")),
                )
            )
        except (KeyError, TypeError, ValueError):
            continue
    return found


@dataclass(frozen=True)
class OwnerView:
    agent: AgentInfo | None
    """The running `gpumesh share`, or None."""
    hosted: list[JobRecord]
    """The newest jobs run here for peers, newest first."""
    sessions: OpenSessions = field(default_factory=OpenSessions)
    """Open shells, desktop connections and CUDA sessions."""

    @property
    def running(self) -> list[JobRecord]:
        return [j for j in self.hosted if j.state not in FINAL_STATES]


def owner_view(node: Node, *, limit: int = 50) -> OwnerView:
    """Who uses this machine: the agent's connected peers, the jobs it hosts, its
    open sessions."""
    home = node.home
    agent = home.agent_info()
    return OwnerView(agent, home.store.jobs(limit=limit, role=JobRole.HOSTED), open_sessions(agent))


@dataclass(frozen=True)
class EndedSession:
    kind: SessionKind
    id: str
    peer: str


async def end_session(
    node: Node, kind: SessionKind, session_id: str, *, timeout: float = END_TIMEOUT
) -> EndedSession:
    """End one open session of the running agent; returns once the agent has."""
    home = node.home
    what = f"{kind} session {session_id}"

    def peer_now() -> str | None:
        return open_sessions(home.agent_info()).find(kind, session_id)

    peer = peer_now() if _SESSION_ID.fullmatch(session_id) else None
    agent = home.agent
    if peer is None or agent is None:
        raise NotFoundError(f"no open {what} on this node; `gpumesh status` lists the open ones")
    agent.end_session(session_id)
    deadline = time.monotonic() + timeout
    while peer_now() is not None:
        if time.monotonic() > deadline:
            raise AgentError(
                f"the sharing agent did not end {what} within {timeout:.0f}s; stop "
                "sharing (`gpumesh share stop`) to end everything"
            )
        await asyncio.sleep(0.05)
    return EndedSession(kind, session_id, peer)


# --- who CUDA workers run as ------------------------------------------------------------


def worker_user(home: Home) -> str | None:
    """The one line saying CUDA workers run as the agent's own user, for the running
    agent (or, when none runs, the one this user would start); None when it is root."""
    agent = home.agent_info() if home.initialized else None
    uid = os.geteuid()
    if agent is not None:
        # Not Linux, or it just ended: this user's.
        with contextlib.suppress(OSError):
            uid = os.stat(f"/proc/{agent.pid}").st_uid  # the process's effective uid
    return worker_user_note(uid)


def worker_user_note(agent_uid: int) -> str | None:
    """The one line the owner is told when CUDA workers cannot run as another user."""
    if agent_uid == 0:
        return None
    return (
        f"CUDA workers run as the agent's own user (uid {agent_uid}, with its groups), not "
        "as job_user: only an agent started as root can switch them to it"
    )
