"""The owner's requests to end one open session (a shell, a desktop connection, a
CUDA session) of the running agent.

The agent owns its sessions; the owner's command or the control API cannot reach
them. Each request is an empty file named by the session's id in ``session-stops``
of the home (0700), written by the owner's side before it pokes the agent
(:meth:`Home.notify_agent`); the agent takes them all, removing each, and ends the
sessions it still has. A request for a session that already ended does nothing.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from gpumesh.store.modes import write_private

__all__ = ["STOPS_DIR", "request_stop", "take_stops", "valid_session_id"]

STOPS_DIR = "session-stops"
_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


def valid_session_id(session_id: str) -> bool:
    """An id the agent could have given (so also a safe file name)."""
    return _SESSION_ID.fullmatch(session_id) is not None


def request_stop(home: Path, session_id: str) -> None:
    """The owner's side: ask the agent to end ``session_id``."""
    if not valid_session_id(session_id):
        raise ValueError(f"not a session id: {session_id!r}")
    folder = home / STOPS_DIR
    folder.mkdir(mode=0o700, exist_ok=True)
    write_private(folder / session_id, b"")


def take_stops(home: Path) -> list[str]:
    """The agent's side: the ids asked for since the last take (each taken once)."""
    folder = home / STOPS_DIR
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    taken = []
    for name in names:
        if not valid_session_id(name):  # e.g. a request still being written
            continue
        with contextlib.suppress(OSError):
            os.unlink(folder / name)
            taken.append(name)
    return taken
