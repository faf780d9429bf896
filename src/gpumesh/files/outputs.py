"""A job's outputs folder, as the provider finds its finished files: a scan, and a
kernel watch that names files as the job closes or renames them.

Everything in the folder is the job's and hostile: names may be anything, and
any path may become a link at any moment. Nothing here reads a file's bytes:
the scan and the watch only produce names with what ``lstat`` said of them
(through directory descriptors, never following a link); what reads the files
later (a download) checks them again through the sandbox. Names that are not
UTF-8, hold control characters or backslashes, or are too long, are skipped,
and so are links, devices and whatever is not a regular file.

:class:`OutputsWatch` (Linux inotify) watches each folder of the tree,
through a descriptor opened without following links (``/proc/self/fd/N``,
``IN_ONLYDIR``):
a file closed after writing (``IN_CLOSE_WRITE``) or renamed into place
(``IN_MOVED_TO``) is ready, never one still being written; a new folder gets
its own watch (at most :data:`MAX_WATCHED` in all: the files of folders past
that come with the scan at the job's end; so does a file finished in a new
folder before its watch was added, a moment after the folder was made: it
cannot be told from one still open); a folder renamed into place is
listed (its files were finished elsewhere); an overflowing queue or a watched
folder moved makes the caller scan again. Not asyncio: the caller waits on
:attr:`OutputsWatch.fd` becoming readable.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from collections.abc import Sequence

from gpumesh.errors import LimitError
from gpumesh.files.inotify import (
    IN_CLOEXEC,
    IN_CLOSE_WRITE,
    IN_CREATE,
    IN_DELETE_SELF,
    IN_IGNORED,
    IN_ISDIR,
    IN_MOVE_SELF,
    IN_MOVED_TO,
    IN_NONBLOCK,
    IN_ONLYDIR,
    IN_Q_OVERFLOW,
    IN_UNMOUNT,
    add_watch,
    events,
    libc,
)
from gpumesh.files.sandbox import Tree, WalkStopped

__all__ = [
    "MAX_OUTPUT_PATH",
    "MAX_SCANNED",
    "MAX_WATCHED",
    "Found",
    "OutputsWatch",
    "open_outputs_watch",
    "scan_outputs",
    "stat_outputs",
    "usable_name",
]

MAX_WATCHED = 1024
"""Folders of one job's outputs watched at most (each takes one inotify watch)."""
MAX_SCANNED = 100_000
"""Files one scan lists at most (a job making more gets the first ones)."""
MAX_OUTPUT_PATH = 4096
"""Longest path of an output file, in bytes, from the outputs folder."""
_NAME_BYTES = 255

Found = tuple[str, int, int, float]
"""A regular file of the outputs: its path from the folder, size, mtime in
nanoseconds, and mtime as ``FileInfo.mtime`` gives it."""

_MASK = IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR
"""No ``IN_DONT_FOLLOW``: the path given is ``/proc/self/fd/N``, a link by nature, to
the folder this process opened without following any link; that link must be
followed to reach it (with the flag, the watch would be refused)."""
_AGAIN = IN_Q_OVERFLOW | IN_DELETE_SELF | IN_MOVE_SELF | IN_UNMOUNT


def usable_name(name: str) -> bool:
    """Whether a name the job made may travel: UTF-8, no control character, no
    backslash, not ``.`` or ``..``, at most 255 bytes."""
    if name in ("", ".", ".."):
        return False
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:  # not UTF-8 on disk (os gives it as surrogates)
        return False
    if len(encoded) > _NAME_BYTES or "\\" in name or "/" in name:
        return False
    return not any(ord(char) < 0x20 or ord(char) == 0x7F for char in name)


def _joined(relative: str, name: str) -> str | None:
    path = f"{relative}/{name}" if relative else name
    return path if len(path.encode("utf-8")) <= MAX_OUTPUT_PATH else None


def scan_outputs(tree: Tree, parts: Sequence[str] = ()) -> list[Found]:
    """Every regular file under ``parts`` of the outputs ``tree`` (blocking), at most
    :data:`MAX_SCANNED`; paths are from the tree's root."""
    found: list[Found] = []
    try:
        for folder in tree.walk(parts):
            keep = []
            for name, st in folder.entries:
                if not usable_name(name):
                    continue
                relative = folder.relative
                path = _joined(relative, name)
                if path is None:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    keep.append((name, st))
                elif stat.S_ISREG(st.st_mode) and len(found) < MAX_SCANNED:
                    found.append((path, st.st_size, st.st_mtime_ns, st.st_mtime))
            folder.entries[:] = keep
    except (OSError, WalkStopped, LimitError):
        pass  # a folder made unreadable, taken away or nested too deep: what was found counts
    return found


def stat_outputs(tree: Tree, paths: Sequence[str]) -> list[Found]:
    """Of ``paths`` (from the outputs folder), those that are regular files now,
    with what ``lstat`` says of them (blocking; a link on the way is no file)."""
    found: list[Found] = []
    for path in paths:
        with contextlib.suppress(OSError):
            st = tree.lstat(path.split("/"))
            if st is not None and stat.S_ISREG(st.st_mode):
                found.append((path, st.st_size, st.st_mtime_ns, st.st_mtime))
    return found


def open_outputs_watch(tree: Tree) -> OutputsWatch | None:
    """A watch of the outputs ``tree`` (its folders watched, none listed for files),
    or None where there is no inotify: the caller then scans now and then."""
    lib = libc()
    if lib is None:
        return None
    fd = int(lib.inotify_init1(IN_NONBLOCK | IN_CLOEXEC))
    if fd < 0:
        return None
    watch = OutputsWatch(lib, fd, tree)
    watch.watch_all()
    return watch


class OutputsWatch:
    """The folders of one outputs tree the kernel watches, by path from its root."""

    def __init__(self, lib: ctypes.CDLL, fd: int, tree: Tree) -> None:
        self._lib = lib
        self.fd = fd
        """Readable when the kernel has news (wait on it, then call :meth:`ready`)."""
        self._tree = tree
        self._paths: dict[int, str] = {}
        """Watch descriptor -> the folder's path from the root (``""``: the root)."""

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _add(self, folder_fd: int, relative: str) -> None:
        if len(self._paths) >= MAX_WATCHED:
            return
        wd = add_watch(self._lib, self.fd, folder_fd, _MASK)
        if wd >= 0:
            self._paths[wd] = relative

    def watch_all(self, parts: Sequence[str] = ()) -> None:
        """Watch every folder under ``parts`` (blocking); the whole tree by default."""
        if not parts:
            self._paths.clear()  # paths may have moved: each is named again
            self._add(self._tree.fd, "")
        with contextlib.suppress(OSError, WalkStopped, LimitError):
            for folder in self._tree.walk(parts):
                if folder.relative:
                    self._add(folder.fd, folder.relative)
                folder.entries[:] = [
                    (name, st)
                    for name, st in folder.entries
                    if stat.S_ISDIR(st.st_mode) and usable_name(name)
                ]

    def ready(self) -> tuple[list[str], bool]:
        """The files finished since the last call, by path from the root, and whether
        the tree must be scanned again (its watches were renewed then); blocking,
        the queue emptied."""
        paths: list[str] = []
        again = False
        moved_in: list[str] = []
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno != errno.EINTR:
                    again = True
                    break
                continue
            for wd, mask, raw in events(data):
                if mask & IN_IGNORED:
                    self._paths.pop(wd, None)
                    continue
                relative = self._paths.get(wd)
                if mask & _AGAIN:
                    again = True
                    continue
                if relative is None or not raw:
                    continue
                try:
                    name = raw.decode("utf-8")
                except UnicodeDecodeError:
                    continue
                if not usable_name(name) or (path := _joined(relative, name)) is None:
                    continue
                if mask & IN_ISDIR:
                    if mask & IN_MOVED_TO:
                        moved_in.append(path)  # finished elsewhere: list it
                    elif mask & IN_CREATE:
                        self._watch_new(path)
                elif mask & (IN_CLOSE_WRITE | IN_MOVED_TO):
                    paths.append(path)
        if again:
            self.watch_all()
            return paths, True
        for path in moved_in:
            self.watch_all(path.split("/"))
            paths.extend(found[0] for found in scan_outputs(self._tree, path.split("/")))
        return paths, False

    def _watch_new(self, path: str) -> None:
        """A folder just made: watched (opened without following a link)."""
        with contextlib.suppress(OSError):
            fd = self._tree.open_dir(path.split("/"))
            try:
                self._add(fd, path)
            finally:
                os.close(fd)
