"""Kernel notice of changes in a folder tree (Linux inotify), for re-scans that
list again only the folders something changed in.

A :class:`FolderWatch` is told of each folder right after it is opened and
before it is listed (:meth:`FolderWatch.add`): whatever changes in it after
that (a file written, truncated, created, deleted, renamed, its mode or times
set) is queued by the kernel before the changing call returns. At the next
scan :meth:`FolderWatch.changed` reads the queue: the folders with a change,
each with its parents up to the root (a folder's own entry in its parent
holds its mtime), or ``None`` when everything must be listed again: the
queue overflowed, a folder was created, deleted or moved, or a watch went.

Where the kernel cannot tell of every change the watch is not used at all
(:func:`open_watch` gives ``None`` and scans list every folder as ever): not
Linux, no inotify or ``/proc``, a file system other than a local one
(:data:`LOCAL_FILE_SYSTEMS`; a network file system's other clients write
unseen), a folder on another device than the root, more than
:data:`MAX_FOLDERS` folders. Two more cases the caller handles: a folder
holding a symlink (its target may change elsewhere) or a file with more than
one link (written through another folder, unseen here) is listed every time.
A file given a second name inside the folder after its own folder was
listed is caught too: a file with a link the last scan did not know makes
the scan list every folder once. What no folder watch sees, and a scan with
one therefore misses until the folder is listed again for another reason (or
the watch is reset): a file written only through a shared memory mapping
after its descriptor closed, and a file given a second name outside the
folder after its own folder was listed and then written through that name.
"""

from __future__ import annotations

import ctypes
import os
import struct
import weakref

from gpumesh.files.inotify import (
    IN_ATTRIB,
    IN_CLOEXEC,
    IN_CLOSE_WRITE,
    IN_CREATE,
    IN_DELETE,
    IN_DELETE_SELF,
    IN_IGNORED,
    IN_ISDIR,
    IN_MODIFY,
    IN_MOVE_SELF,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    IN_NONBLOCK,
    IN_ONLYDIR,
    IN_Q_OVERFLOW,
    IN_UNMOUNT,
    add_watch,
    events,
)
from gpumesh.files.inotify import libc as _libc

__all__ = ["LOCAL_FILE_SYSTEMS", "MAX_FOLDERS", "FolderWatch", "file_system", "open_watch"]

MAX_FOLDERS = 4096
"""Folders watched in one tree at most (each takes one of the user's inotify watches)."""

LOCAL_FILE_SYSTEMS = frozenset(
    {
        0xEF53,  # ext2/3/4
        0x58465342,  # xfs
        0x9123683E,  # btrfs
        0x01021994,  # tmpfs
        0xF2F52010,  # f2fs
    }
)
"""``statfs`` magic numbers of the file systems whose every change inotify sees."""

_MASK = (
    IN_MODIFY
    | IN_ATTRIB
    | IN_CLOSE_WRITE
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CREATE
    | IN_DELETE
    | IN_DELETE_SELF
    | IN_MOVE_SELF
    | IN_ONLYDIR
)
_ALL_AGAIN = IN_Q_OVERFLOW | IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF | IN_UNMOUNT
"""Events after which the folders' paths or the queue can no longer be trusted."""
_TREE_CHANGED = IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO
"""With ``IN_ISDIR``: a folder came or went (the paths of watched folders may differ)."""


def file_system(fd: int) -> int | None:
    """The ``statfs`` magic number of the file system ``fd`` lies on."""
    lib = _libc()
    if lib is None:
        return None
    buffer = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if lib.statfs(f"/proc/self/fd/{fd}".encode(), buffer) != 0:
        return None
    (magic,) = struct.unpack_from("l", buffer)
    return int(magic) & 0xFFFFFFFF


def open_watch(root_fd: int) -> FolderWatch | None:
    """A watch for the tree whose root folder ``root_fd`` is, or None where the
    kernel cannot tell of every change in it (see the module's notes)."""
    lib = _libc()
    if lib is None or file_system(root_fd) not in LOCAL_FILE_SYSTEMS:
        return None
    fd = lib.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
    if fd < 0:
        return None
    return FolderWatch(lib, fd, os.fstat(root_fd).st_dev)


class FolderWatch:
    """The folders of one tree the kernel watches, by their path from the root."""

    def __init__(self, lib: ctypes.CDLL, fd: int, device: int) -> None:
        self._lib = lib
        self._fd = fd
        self._device = device
        self._paths: dict[int, str] = {}
        """Watch descriptor -> the folder's path from the root (``""``: the root)."""
        self._closer = weakref.finalize(self, os.close, fd)

    def add(self, folder_fd: int, relative: str) -> bool:
        """Watch the folder ``folder_fd`` (just opened, not yet listed) at ``relative``;
        False when it cannot be watched (then the watch must not be trusted)."""
        if len(self._paths) >= MAX_FOLDERS or os.fstat(folder_fd).st_dev != self._device:
            return False
        wd = add_watch(self._lib, self._fd, folder_fd, _MASK)
        if wd < 0:
            return False
        known = self._paths.setdefault(wd, relative)
        return known == relative  # one folder at two paths (a bind mount): not trusted

    def changed(self) -> set[str] | None:
        """The folders changed since they were added (with their parents), or None
        when every folder must be listed again; the queue is emptied either way."""
        changed: set[str] = set()
        again = False
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:  # (EINTR is retried by os.read itself: PEP 475)
                break
            for wd, mask, _name in events(data):
                relative = self._paths.get(wd)
                tree_changed = mask & IN_ISDIR and mask & _TREE_CHANGED
                if relative is None or mask & _ALL_AGAIN or tree_changed:
                    again = True
                    continue
                while relative not in changed:
                    changed.add(relative)
                    if not relative:
                        break
                    relative = relative.rpartition("/")[0]
        return None if again else changed

    def close(self) -> None:
        self._closer()
