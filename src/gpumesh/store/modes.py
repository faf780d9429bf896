"""Modes of a node's private state: files 0600 in a home that is 0700.

What a home holds (settings with tokens, the database of peers and of jobs
with their environment, debug logs) is for its user only. Files are created
with their mode from the first byte and narrowed when found wider. Nothing
here touches the process umask: files the CLI writes for its user elsewhere
(downloads, pulled outputs) keep the modes they are meant to have. On Windows
mode bits say little (a home's privacy is its folder's ACL, from the user's
profile): the same calls run, with the flags and ``fchmod`` it lacks left out.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from gpumesh import platform

__all__ = [
    "PRIVATE_DIR",
    "PRIVATE_FILE",
    "create_private",
    "narrow",
    "open_private",
    "write_private",
]

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def narrow(path: Path, mode: int) -> None:
    """Take away every permission beyond ``mode`` from ``path``; an absent path is left so.

    Never adds a permission: a file found 0400 stays 0400.
    """
    try:
        current = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return
    if current & ~mode:
        os.chmod(path, current & mode)


def open_private(path: str | Path, flags: int) -> int:
    """Open ``path`` (created 0600, narrowed to 0600 if it exists wider); the descriptor."""
    fd = os.open(path, flags | os.O_CREAT | platform.open_flag("O_CLOEXEC"), PRIVATE_FILE)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) & ~PRIVATE_FILE:
            platform.chmod_open(fd, path, PRIVATE_FILE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_private(path: Path) -> None:
    """Make sure ``path`` exists and is 0600 (created so, or narrowed), without ever
    opening a file that already exists.

    For files that SQLite holds open in this process: closing any descriptor of a
    file drops every POSIX lock the process holds on it, SQLite's included, and a
    connection that lost its locks can read a stale snapshot or write over another's.
    """
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | platform.open_flag("O_CLOEXEC")
        fd = os.open(path, flags, PRIVATE_FILE)
    except FileExistsError:
        narrow(path, PRIVATE_FILE)
    else:
        os.close(fd)  # a file made just now: no lock of this process is on it


def write_private(path: Path, data: bytes) -> None:
    """Replace ``path`` atomically by a file that is 0600 from its first byte."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(open_private(tmp, os.O_WRONLY | os.O_TRUNC), "wb") as out:
        out.write(data)
    os.replace(tmp, path)
