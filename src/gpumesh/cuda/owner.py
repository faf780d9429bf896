"""What the owner sees of this node's CUDA remoting: the share, the allowlist, sessions.

:func:`worker_user` is the line ``cuda share``, ``cuda doctor`` and ``doctor``
print when the workers cannot run as ``job_user`` (the agent is not root).

The agent writes its open CUDA sessions to ``cuda-sessions.json`` in the home
(only the agent writes it, and it removes it when it stops); ``status`` and
``cuda doctor`` read it here, and trust it only while that agent runs.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumesh.cuda.confine import worker_user_note
from gpumesh.store.home import Home
from gpumesh.store.modes import write_private

__all__ = [
    "SESSIONS_FILE",
    "OwnerSession",
    "clear_sessions",
    "open_sessions",
    "sessions_at",
    "worker_user",
    "write_sessions",
]

SESSIONS_FILE = "cuda-sessions.json"


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
    agent = home.read_agent_info() if home.initialized else None
    uid = os.geteuid()
    if agent is not None:
        # Not Linux, or it just ended: this user's.
        with contextlib.suppress(OSError):
            uid = os.stat(f"/proc/{agent.pid}").st_uid  # the process's effective uid
    return worker_user_note(uid)


def _path(home: Path) -> Path:
    return home / SESSIONS_FILE


def write_sessions(home: Path, sessions: list[dict[str, Any]]) -> None:
    """The agent's side: its sessions now."""
    data = {"agent": os.getpid(), "sessions": sessions}
    write_private(_path(home), json.dumps(data).encode())


def clear_sessions(home: Path) -> None:
    _path(home).unlink(missing_ok=True)


def open_sessions(home: Home) -> list[OwnerSession]:
    """The running agent's CUDA sessions (none when it does not run)."""
    agent = home.read_agent_info()
    return [] if agent is None else sessions_at(home.path, agent.pid)


def sessions_at(home: Path, agent_pid: int) -> list[OwnerSession]:
    """The CUDA sessions that the agent ``agent_pid`` published in ``home``."""
    try:
        data = json.loads(_path(home).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(data, dict) or data.get("agent") != agent_pid:
        return []
    found = []
    for item in data.get("sessions", []):
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
