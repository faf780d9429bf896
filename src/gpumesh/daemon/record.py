"""Who holds a home: the node process's lock and its record, without I/O but files.

One node process per home: it holds an exclusive ``flock`` on ``node.lock`` for
its whole life (the kernel drops it when the process dies, however it dies, so a
crashed node never blocks the next one) and writes ``node.json`` (pid, version,
addresses) next to it, 0600. A reader trusts the record only while the lock is
held. Imports only the standard library and the base floor: the thin CLI reads it.

Where there is no ``flock`` (Windows), the lock is ``msvcrt.locking`` of the
file's first byte: also dropped when the process dies, but exclusive only, so
a reader's look takes it for an instant, and a look or a take that finds it
held looks once more before believing it. ``GPUMESH_TEST_PLATFORM=windows``
takes that way on Linux, a POSIX record lock of the same byte standing in for
``msvcrt`` (as exclusive, and as dropped with the process).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from gpumesh import platform
from gpumesh.settings import ENV_TEST_PLATFORM, ENV_TEST_WITHOUT, env

__all__ = [
    "LOCK_NAME",
    "RECORD_NAME",
    "HomeLock",
    "NodeRecord",
    "holder",
    "last_share_end",
    "read_record",
]

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
    sharing_since: float | None = None
    """When the home's share it runs started; None while it does not share."""
    share_ended: tuple[float, str] | None = None
    """When and how the home's last share ended (kept in the record a node process
    leaves behind, and carried over by the next one)."""


def read_record(home: Path) -> NodeRecord | None:
    """The record in ``home``, or None when missing or unreadable."""
    try:
        data = json.loads((home / RECORD_NAME).read_text())
        since = data.get("sharing_since")
        ended = data.get("share_ended")
        return NodeRecord(
            pid=int(data["pid"]),
            version=str(data["version"]),
            started_at=float(data["started_at"]),
            api=[str(a) for a in data.get("api", [])],
            tcp=bool(data.get("tcp", False)),
            sharing_since=None if since is None else float(since),
            share_ended=None if not ended else (float(ended[0]), str(ended[1])),
        )
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def last_share_end(home: Path) -> tuple[float, str] | None:
    """When and how ``home``'s last share ended; None while it shares, or when it
    never shared. A node process that died while sharing (killed, crashed) left its
    record saying it shared: that is how it ended."""
    record = read_record(home)
    if record is None:
        return None
    if record.sharing_since is not None:
        if holder(home) is not None:
            return None  # it shares now
        try:
            at = (home / RECORD_NAME).stat().st_mtime
        except OSError:
            at = record.sharing_since
        return (
            at,
            f"its node process (pid {record.pid}) ended without stopping it (killed or crashed)",
        )
    return record.share_ended


_CLOEXEC = getattr(os, "O_CLOEXEC", 0)  # Windows' os.open never lets children inherit
SECOND_LOOK = 0.02
"""Seconds before a byte lock found held is tried once more (someone's look)."""


def _flock_here() -> bool:
    """Whether homes are locked with ``flock``: ``platform.has("fcntl")``, answered
    here when plainly yes (no simulated platform): importing :mod:`gpumesh.platform`
    costs a thin command milliseconds."""

    if not (env(ENV_TEST_PLATFORM) or env(ENV_TEST_WITHOUT)):
        return find_spec("fcntl") is not None

    return platform.has("fcntl")


def _try_lock(fd: int, *, shared: bool) -> bool:
    """Lock ``fd``'s file without waiting (``shared``: a look, where locks can be
    shared); whether it was taken."""
    if _flock_here():
        import fcntl

        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError:
            return False
        return True
    for look in range(2):
        if look:
            time.sleep(SECOND_LOOK)
        try:
            _byte_lock(fd, lock=True)
        except OSError:
            continue
        return True
    return False


def _unlock(fd: int) -> None:
    if _flock_here():
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_UN)
    else:
        _byte_lock(fd, lock=False)


def _byte_lock(fd: int, *, lock: bool) -> None:
    """Lock (or unlock) the first byte of ``fd``'s file, exclusively, without waiting
    (``OSError`` when it is held): ``msvcrt.locking``, or where there is no
    ``msvcrt`` (a simulated Windows) a POSIX record lock of that byte."""
    if find_spec("msvcrt") is not None:
        msvcrt: Any = importlib.import_module("msvcrt")
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_NBLCK if lock else msvcrt.LK_UNLCK, 1)
        return
    import fcntl

    fcntl.lockf(fd, (fcntl.LOCK_EX | fcntl.LOCK_NB) if lock else fcntl.LOCK_UN, 1, 0)


def holder(home: Path) -> NodeRecord | None:
    """The node process holding ``home`` now (its record), or None when the lock is
    free. A holder whose record is not written yet reads as pid 0."""
    # A byte lock is exclusive, which POSIX takes only on a file open for writing.
    mode = os.O_RDONLY if _flock_here() else os.O_RDWR
    try:
        fd = os.open(home / LOCK_NAME, mode | _CLOEXEC)
    except OSError:
        return None
    try:
        if not _try_lock(fd, shared=True):
            return read_record(home) or NodeRecord(pid=0, version="", started_at=0.0)
        _unlock(fd)
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
        fd = os.open(self.home / LOCK_NAME, os.O_RDWR | os.O_CREAT | _CLOEXEC, 0o600)
        if not _try_lock(fd, shared=False):
            os.close(fd)
            return False
        self._fd = fd
        return True

    def write(self, record: NodeRecord) -> None:
        """Publish ``record`` (atomically: a reader sees the old one or the new one)."""
        path = self.home / RECORD_NAME
        temp = path.with_name(f".{RECORD_NAME}.{os.getpid()}")

        nofollow = platform.open_flag("O_NOFOLLOW")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | nofollow, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(asdict(record), out)
        os.replace(temp, path)

    def release(self, last: NodeRecord | None = None) -> None:
        """Let the home go. ``last``: a record to leave behind (how the home's last
        share ended) instead of none."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if last is not None and last.share_ended is not None:
                self.write(replace(last, api=[], tcp=False, sharing_since=None))
            else:
                (self.home / RECORD_NAME).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            _unlock(self._fd)  # Windows asks for it before the close
        os.close(self._fd)  # closing the descriptor drops the lock
        self._fd = None
