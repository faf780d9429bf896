"""What the owner sees of this node's CUDA remoting: the share, the allowlist, sessions.

:func:`worker_user` is the line ``cuda share``, ``cuda doctor`` and ``doctor``
print when the workers cannot run as ``job_user`` (the agent is not root).

The running agent's open CUDA sessions come from what it says of itself
(:meth:`Home.agent_info`); ``status`` and ``cuda doctor`` read them here.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from gpumesh.cuda.confine import worker_user_note
from gpumesh.store.home import AgentInfo, Home

__all__ = ["OwnerSession", "open_sessions", "sessions_of", "worker_user"]


@dataclass(frozen=True)
class OwnerSession:
    peer: str
    memory: int
    backend: str
    device: str
    gpus: list[str]
    started: float
    pid: int
    id: str = ""
    """How the owner names it to end it."""


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


def open_sessions(home: Home) -> list[OwnerSession]:
    """The running agent's CUDA sessions (none when it does not run)."""
    agent = home.agent_info()
    return [] if agent is None else sessions_of(agent)


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
