"""Who holds a home: the node process's lock and its record, without I/O but files.

One node process per home: it holds an exclusive ``flock`` on ``node.lock`` for
its whole life (the kernel drops it when the process dies, however it dies, so a
crashed node never blocks the next one) and writes ``node.json`` (pid, version,
addresses) next to it, 0600. A reader trusts the record only while the lock is
held. Imports only the standard library and the base floor: the thin CLI reads it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["LOCK_NAME", "RECORD_NAME", "HomeLock", "NodeRecord", "holder", "read_record"]

LOCK_NAME = "node.lock"
RECORD_NAME = "node.json"


@dataclass(frozen=True)
class NodeRecord:
    """What a running node process says about itself in ``node.json``."""

    pid: int
    version: str
    started_at: float
    api: list[str] = field(default_factory=list)
    """Where its control API listens: the unix socket's path, ``http://host:port``."""
    tcp: bool = False
    """It serves TCP too (then it never exits for being idle)."""


def read_record(home: Path) -> NodeRecord | None:
    """The record in ``home``, or None when missing or unreadable."""
    try:
        data = json.loads((home / RECORD_NAME).read_text())
        return NodeRecord(
            pid=int(data["pid"]),
            version=str(data["version"]),
            started_at=float(data["started_at"]),
            api=[str(a) for a in data.get("api", [])],
            tcp=bool(data.get("tcp", False)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def holder(home: Path) -> NodeRecord | None:
    """The node process holding ``home`` now (its record), or None when the lock is
    free. A holder whose record is not written yet reads as pid 0."""
    try:
        fd = os.open(home / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return read_record(home) or NodeRecord(pid=0, version="", started_at=0.0)
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


class HomeLock:
    """The exclusive hold of a home, for one process's life (or until released)."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self._fd: int | None = None

    def acquire(self) -> bool:
        """Take the home; False when another process holds it."""
        fd = os.open(self.home / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def write(self, record: NodeRecord) -> None:
        """Publish ``record`` (atomically: a reader sees the old one or the new one)."""
        path = self.home / RECORD_NAME
        temp = path.with_name(f".{RECORD_NAME}.{os.getpid()}")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(asdict(record), out)
        os.replace(temp, path)

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            (self.home / RECORD_NAME).unlink(missing_ok=True)
        os.close(self._fd)  # closing the descriptor drops the lock
        self._fd = None


def new_record(api: list[str], *, tcp: bool, version: str) -> NodeRecord:
    return NodeRecord(pid=os.getpid(), version=version, started_at=time.time(), api=api, tcp=tcp)
