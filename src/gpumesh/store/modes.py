"""Modes of a node's private state: files 0600 in a home that is 0700.

What a home holds (settings with tokens, the database of peers and of jobs
with their environment, debug logs) is for its user only. Files are created
with their mode from the first byte and narrowed when found wider. Nothing
here touches the process umask: files the CLI writes for its user elsewhere
(downloads, pulled outputs) keep the modes they are meant to have. On Windows
mode bits say little (a home's privacy is its folder's ACL, from the user's
profile): the same calls run, with the flags and ``fchmod`` it lacks left out.

A home is trusted only when its user owns it and nobody else may write in it
(:func:`gpumesh.store.trust.check_home`): another account that pre-created the folder in a shared
place, or can write there, could plant or swap the files in it. The home itself
may be a link to a folder of its user's. Files in it are never opened through
a link (:func:`read_private`, :func:`open_private`, :func:`refuse_link`): a
link planted as ``gpumesh.db`` would have the node write its state, or narrow
the modes of, wherever it points.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from gpumesh import platform
from gpumesh.errors import ConfigError

__all__ = [
    "PRIVATE_DIR",
    "PRIVATE_FILE",
    "create_private",
    "narrow",
    "open_private",
    "read_private",
    "refuse_link",
    "write_private",
]

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def _link_error(path: str | Path) -> ConfigError:
    return ConfigError(
        f"{path} is a link: GPUMesh opens no links in its home, a link planted there "
        f"could send its state elsewhere; remove it (`rm {path}`) and run the command again"
    )


def refuse_link(path: str | Path) -> os.stat_result | None:
    """Refuse ``path`` when it is a link; its ``lstat`` (None: absent, which passes)."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(found.st_mode):
        raise _link_error(path)
    return found


def _open(path: str | Path, flags: int, mode: int = PRIVATE_FILE) -> int:
    """``os.open`` that never follows a link at ``path`` (refused in one line)."""
    flags |= platform.open_flag("O_NOFOLLOW") | platform.open_flag("O_CLOEXEC")
    try:
        return os.open(path, flags, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _link_error(path) from None
        raise


def read_private(path: str | Path) -> bytes:
    """The bytes of ``path``, opened without following a link (one is refused)."""
    if not platform.has("nofollow"):
        refuse_link(path)
    with open(_open(path, os.O_RDONLY | platform.BINARY), "rb") as found:
        return found.read()


def narrow(path: Path, mode: int) -> None:
    """Take away every permission beyond ``mode`` from ``path``; an absent path is left so.

    Never adds a permission: a file found 0400 stays 0400. A link is refused, never
    followed: its target may be anybody's file.
    """
    found = refuse_link(path)
    if found is None:
        return
    current = stat.S_IMODE(found.st_mode)
    if current & ~mode:
        os.chmod(path, current & mode)


def open_private(path: str | Path, flags: int) -> int:
    """Open ``path`` (created 0600, narrowed to 0600 if it exists wider; a link is
    refused); the descriptor."""
    if not platform.has("nofollow"):
        refuse_link(path)
    fd = _open(path, flags | os.O_CREAT)
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
        fd = _open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:  # O_EXCL: a link there is found to exist, never followed
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
