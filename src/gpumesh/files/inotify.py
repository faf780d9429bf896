"""The kernel's inotify through the C library (Linux): loaded once, with the event
constants and the record layout the folder watches share.

Where there is no inotify (not Linux, a C library without it), :func:`libc` is
None and callers go without a watch. Nothing here follows a path a peer could
change: watches are added through ``/proc/self/fd/N`` of a folder the caller
opened itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import struct
import sys
import threading
from collections.abc import Iterator

__all__ = [
    "EVENT",
    "IN_ATTRIB",
    "IN_CLOEXEC",
    "IN_CLOSE_WRITE",
    "IN_CREATE",
    "IN_DELETE",
    "IN_DELETE_SELF",
    "IN_DONT_FOLLOW",
    "IN_IGNORED",
    "IN_ISDIR",
    "IN_MODIFY",
    "IN_MOVED_FROM",
    "IN_MOVED_TO",
    "IN_MOVE_SELF",
    "IN_NONBLOCK",
    "IN_ONLYDIR",
    "IN_Q_OVERFLOW",
    "IN_UNMOUNT",
    "add_watch",
    "events",
    "libc",
]

IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_CLOSE_WRITE = 0x8
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_UNMOUNT = 0x2000
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x1000000
IN_DONT_FOLLOW = 0x2000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = getattr(os, "O_NONBLOCK", 0o4000)  # inotify is Linux-only; Windows lacks it
IN_CLOEXEC = 0o2000000

EVENT = struct.Struct("iIII")
"""``struct inotify_event`` before its name: wd, mask, cookie, length of the name."""


class _Libc:
    """inotify and statfs from the C library, loaded once (None where missing)."""

    lock = threading.Lock()
    loaded = False
    lib: ctypes.CDLL | None = None


def libc() -> ctypes.CDLL | None:
    """The C library with ``inotify_init1``, ``inotify_add_watch`` and ``statfs``
    typed, or None where it lacks them."""
    with _Libc.lock:
        if not _Libc.loaded:
            _Libc.loaded = True
            if sys.platform.startswith("linux"):
                with contextlib.suppress(OSError, AttributeError):
                    lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
                    for name in ("inotify_init1", "inotify_add_watch", "statfs"):
                        getattr(lib, name)
                    lib.inotify_init1.argtypes = [ctypes.c_int]
                    add = lib.inotify_add_watch
                    add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
                    lib.statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
                    _Libc.lib = lib
        return _Libc.lib


def add_watch(lib: ctypes.CDLL, inotify_fd: int, folder_fd: int, mask: int) -> int:
    """Watch the folder open as ``folder_fd`` (never a name a peer could swap);
    the watch descriptor, or -1."""
    return int(lib.inotify_add_watch(inotify_fd, f"/proc/self/fd/{folder_fd}".encode(), mask))


def events(data: bytes) -> Iterator[tuple[int, int, bytes]]:
    """The ``(wd, mask, name)`` of each event in ``data`` (one read of the queue);
    ``name`` without its padding, empty for an event on the watched folder itself."""
    offset = 0
    while offset + EVENT.size <= len(data):
        wd, mask, _cookie, size = EVENT.unpack_from(data, offset)
        start = offset + EVENT.size
        offset = start + size
        yield wd, mask, data[start:offset].rstrip(b"\0")
