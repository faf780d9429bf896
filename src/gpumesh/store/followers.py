"""Wake-ups for followers of hosted jobs in other processes (``gpumesh logs -f``).

The running agent appends a hosted job's events to SQLite; a follower in
another process reads them there. Instead of polling, each follower binds a
datagram socket of its own in ``$GPUMESH_HOME/followers/`` (0700) and the
agent sends every socket there an empty datagram when any hosted job gets
events: the follower then re-reads the store. The datagram carries nothing,
so a socket planted there learns nothing but that something changed. A
follower still re-reads on a long timer, so a missed wake-up (a full socket
buffer, an older agent) only delays, never loses, an event.

The socket's path may be longer than ``sun_path`` allows: it is then reached
through a descriptor of the folder (``/proc/self/fd/N/NAME``), as
:mod:`gpumesh.store.home` does for the agent's own socket. Where there are no
unix datagram sockets (Windows) or no ``/proc`` for a long path (macOS), a
:class:`FollowerSocket` cannot be made (``OSError``) and its follower polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import secrets
import socket
import time
from pathlib import Path

from gpumesh import platform
from gpumesh.store.sockets import socket_name

__all__ = ["FOLDER", "FollowerSocket", "FollowerWakeups"]

FOLDER = "followers"
_SUFFIX = ".sock"
_RELIST = 1.0
"""Seconds a listing of the followers' folder is trusted while its stamp stays."""


class FollowerSocket:
    """One follower's wake-up socket: :meth:`wait` returns when the agent signals
    (or after ``timeout``). Close it to remove its file."""

    def __init__(self, home: Path) -> None:
        self.folder = home / FOLDER
        self.folder.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.folder, 0o700)  # one made wider by hand is narrowed again
        self.name = f"{secrets.token_hex(8)}{_SUFFIX}"
        if not platform.has("unix"):
            raise OSError(errno.EAFNOSUPPORT, "no unix datagram sockets here")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            with socket_name(self.folder, self.name) as where:
                self._sock.bind(where)
            os.chmod(self.folder / self.name, 0o600)
            self._sock.setblocking(False)
        except BaseException:
            self._sock.close()
            raise

    async def wait(self, timeout: float) -> bool:
        """Wait for a wake-up, at most ``timeout`` seconds; True when one came."""
        if self._drain():
            return True
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(self._sock.fileno(), readable)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ready, timeout)
        finally:
            loop.remove_reader(self._sock.fileno())
        return self._drain()

    def _drain(self) -> bool:
        woken = False
        with contextlib.suppress(BlockingIOError, InterruptedError):
            for _ in range(64):  # a burst becomes one wake-up
                self._sock.recv(16)
                woken = True
        return woken

    def close(self) -> None:
        self._sock.close()
        with contextlib.suppress(OSError):
            (self.folder / self.name).unlink()

    def __enter__(self) -> FollowerSocket:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class FollowerWakeups:
    """The agent's side: signal every follower's socket. Never blocks, never raises;
    a socket nobody reads any more (its follower died) is removed."""

    def __init__(self, home: Path) -> None:
        self.folder = home / FOLDER
        self._listed: tuple[int, float, list[str]] = (-1, 0.0, [])
        self._sock: socket.socket | None = None

    def wake(self) -> int:
        """Signal the followers; how many were signalled."""
        names = self._names()
        if not names:
            return 0
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
        woken = 0
        for name in names:
            try:
                with socket_name(self.folder, name) as where:
                    self._sock.sendto(b"", where)
                woken += 1
            except (ConnectionRefusedError, FileNotFoundError):
                with contextlib.suppress(OSError):
                    (self.folder / name).unlink()  # its follower is gone
            except OSError:
                continue  # its buffer is full: it has a wake-up waiting already
        return woken

    def _names(self) -> list[str]:
        # Listed again when the folder changed (a follower came or went), and at
        # least every second: a change within the clock's tick keeps its stamp.
        try:
            stamp = os.stat(self.folder).st_mtime_ns
        except OSError:
            return []
        now = time.monotonic()
        if stamp != self._listed[0] or now - self._listed[1] > _RELIST:
            try:
                names = [n for n in os.listdir(self.folder) if n.endswith(_SUFFIX)]
            except OSError:
                return []
            self._listed = (stamp, now, names)
        return self._listed[2]

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
