"""A folder that something hostile can change while we work in it, reached only through descriptors.

A peer's sandbox on the provider is written by that peer's jobs while the
agent reads, writes, walks and renames in it: a job can rename a folder and
put a symlink to any host path in its place at any instant. So nothing here
ever names a path below the root again after checking it. Every operation
starts from a directory descriptor and opens one component at a time without
following links: ``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
RESOLVE_NO_MAGICLINKS)`` where the kernel has it (Linux 5.6+), else a walk
with ``O_NOFOLLOW | O_DIRECTORY`` per component. Renames, unlinks, chowns and
stats take ``dir_fd=`` and a single name; walks descend through descriptors
and check with ``fstat`` that what they opened is what they listed. A folder
swapped for a symlink mid-operation yields an error (``ELOOP``) or the
sandbox's own content, never a byte or an inode outside it.

The root itself is the agent's own folder (``files/<peer id>``, ``jobs/<id>/
work``); only what lies below it is untrusted.

Blocking (every call is a system call); the agent runs these on worker threads.
This module knows nothing of peers, requests or quotas.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import stat
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from gpumesh.errors import LimitError

__all__ = [
    "MAX_DEPTH",
    "Folder",
    "Tree",
    "WalkStopped",
    "list_entries",
    "open_beneath",
    "openat2_available",
    "pause_point",
    "use_openat2",
]

MAX_DEPTH = 256
"""Folders nested deeper than this under a root are refused: a walk holds one
descriptor per level, and a job could nest folders without end to hide bytes
from the quota or exhaust the agent's descriptors."""

# getattr: a consumer on Windows imports this module (through pack.py) but
# never opens a Tree there, and Windows has none of these flags.
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
_DIR_FLAGS |= getattr(os, "O_CLOEXEC", 0)
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_READ_FLAGS |= getattr(os, "O_CLOEXEC", 0)
"""O_NONBLOCK: a named pipe put where a file was must not block the open."""

# --- openat2 ---------------------------------------------------------------------------------

_SYS_OPENAT2 = 437
"""The same number on every Linux architecture (new system calls share one table)."""
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08


class _Openat2:
    """Whether to use openat2, decided once by a probe (tests can force the walk)."""

    lock = threading.Lock()
    enabled: bool | None = None
    """None: not probed yet."""
    call: Callable[[int, str, int, int], int] | None = None
    """openat2(dir_fd, path, flags, mode) through libc's syscall(2)."""


def openat2_available() -> bool:
    """Whether this kernel (and any seccomp filter around us) lets openat2 through."""
    if _Openat2.enabled is None:
        with _Openat2.lock:
            if _Openat2.enabled is None:
                _Openat2.enabled = _probe_openat2()
    return _Openat2.enabled


def use_openat2(enabled: bool | None) -> None:
    """Force openat2 on (when the kernel has it) or off (the component walk), or
    ``None`` to probe again. For tests, which exercise both paths."""
    with _Openat2.lock:
        _Openat2.enabled = None if enabled is None else (enabled and _probe_openat2())


def _probe_openat2() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        syscall = libc.syscall
    except (OSError, AttributeError):
        return False
    syscall.restype = ctypes.c_long

    class OpenHow(ctypes.Structure):
        _fields_ = (
            ("flags", ctypes.c_uint64),
            ("mode", ctypes.c_uint64),
            ("resolve", ctypes.c_uint64),
        )

    resolve = _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS

    def call(dir_fd: int, path: str, flags: int, mode: int) -> int:
        how = OpenHow(flags, mode, resolve)
        encoded = os.fsencode(path)
        while True:
            fd = syscall(
                ctypes.c_long(_SYS_OPENAT2),
                ctypes.c_int(dir_fd),
                ctypes.c_char_p(encoded),
                ctypes.byref(how),
                ctypes.c_size_t(ctypes.sizeof(how)),
            )
            if fd >= 0:
                return int(fd)
            code = ctypes.get_errno()
            if code != errno.EINTR:
                raise OSError(code, os.strerror(code), path)

    _Openat2.call = call
    root = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = call(root, ".", _DIR_FLAGS, 0)
    except OSError:
        return False
    finally:
        os.close(root)
    os.close(fd)
    return True


# --- the seam for tests ----------------------------------------------------------------------


class _Seam:
    hook: Callable[[str, str], None] | None = None


def pause_point(where: str, name: str = "") -> None:
    """Where a name-based implementation would have a gap between check and use.

    A no-op in production. Tests install a hook (``_Seam.hook``) that swaps
    folders and symlinks at exactly this instant, so the races they prove
    harmless are reproduced deterministically, not by luck.
    """
    hook = _Seam.hook
    if hook is not None:
        hook(where, name)


# --- opening beneath a folder ----------------------------------------------------------------


def open_beneath(dir_fd: int, parts: Sequence[str], flags: int, mode: int = 0) -> int:
    """``open(2)`` of ``parts`` below ``dir_fd``: never above it, never through a link.

    ``parts`` are single names (checked by the caller: no ``/``, no ``..``);
    ``()`` opens ``dir_fd`` itself again. A symlink anywhere on the way,
    the last component included, raises ``OSError(ELOOP)``; a file where a
    folder must be, ``ENOTDIR``; a missing one, ``ENOENT``.
    """
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    for part in parts:
        if part in ("", ".", "..") or "/" in part:
            raise OSError(errno.EXDEV, "not a single name below the folder", part)
    if not parts:
        return os.open(".", flags & ~os.O_NOFOLLOW, dir_fd=dir_fd)
    if openat2_available():
        assert _Openat2.call is not None  # set by the probe that enabled it
        # RESOLVE_NO_SYMLINKS covers the last component too, and says ELOOP for it
        # (with O_NOFOLLOW | O_DIRECTORY the kernel would say ENOTDIR instead).
        return _Openat2.call(dir_fd, "/".join(parts), flags & ~os.O_NOFOLLOW, mode)
    return _walk_open(dir_fd, parts, flags, mode)


def _walk_open(dir_fd: int, parts: Sequence[str], flags: int, mode: int) -> int:
    current = dir_fd
    try:
        for index, part in enumerate(parts):
            last = index == len(parts) - 1
            pause_point("component", part)
            try:
                opened = os.open(part, flags if last else _DIR_FLAGS, mode, dir_fd=current)
            except OSError as exc:
                raise _named(exc, current, part) from None
            if current != dir_fd:
                os.close(current)
            current = opened
        return current
    except BaseException:
        if current != dir_fd:
            os.close(current)
        raise


def _named(exc: OSError, dir_fd: int, name: str) -> OSError:
    """``O_DIRECTORY | O_NOFOLLOW`` on a symlink says ENOTDIR; say ELOOP, as openat2 does."""
    if exc.errno == errno.ENOTDIR:
        with contextlib.suppress(OSError):
            if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                return OSError(errno.ELOOP, os.strerror(errno.ELOOP), name)
    return exc


def _too_deep() -> LimitError:
    return LimitError(
        f"folders nest deeper than {MAX_DEPTH} levels there; flatten them and try again"
    )


# --- walking ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Folder:
    """One folder met by :meth:`Tree.walk`.

    ``fd`` is open only until the walk moves on; ``entries`` are its names in
    sorted order with their ``lstat``, subfolders included.
    """

    relative: str
    """From the walk's start, ``/``-separated; ``""`` for the start itself."""
    fd: int
    entries: list[tuple[str, os.stat_result]]


def _walk(start_fd: int, prefix: str) -> Iterator[Folder]:
    """Depth-first, each folder before its subfolders; one descriptor per level.

    The subfolders descended into are those left in ``entries`` when the
    caller resumes the walk (it may remove some, as with ``os.walk``). A
    folder that cannot be read raises ``PermissionError`` naming it.
    """
    stack: list[tuple[str, int, Iterator[str]]] = []
    try:
        folder = Folder(prefix, start_fd, list_entries(start_fd, prefix))
        yield folder
        stack.append((prefix, start_fd, _subfolders(folder.entries)))
        while stack:
            relative, fd, pending = stack[-1]
            name = next(pending, None)
            if name is None:
                stack.pop()
                if fd != start_fd:
                    os.close(fd)
                continue
            if len(stack) > MAX_DEPTH:
                raise _too_deep()
            pause_point("walk", name)
            child_relative = f"{relative}/{name}" if relative else name
            child = _open_listed_dir(fd, name, child_relative)
            if child is None:
                continue
            try:
                folder = Folder(child_relative, child, list_entries(child, child_relative))
            except BaseException:
                os.close(child)
                raise
            stack.append((child_relative, child, iter(())))
            yield folder
            stack[-1] = (child_relative, child, _subfolders(folder.entries))
    finally:
        for _relative, fd, _pending in stack:
            if fd != start_fd:
                os.close(fd)


def list_entries(folder: int | str, relative: str) -> list[tuple[str, os.stat_result]]:
    """The names in ``folder`` (a descriptor or a path) in sorted order with their
    ``lstat``; a folder that cannot be read raises ``PermissionError`` naming
    ``relative``."""
    found = []
    try:
        with os.scandir(folder) as scanner:
            for item in scanner:
                try:
                    found.append((item.name, item.stat(follow_symlinks=False)))
                except FileNotFoundError:  # removed since the listing
                    continue
    except PermissionError as exc:
        raise PermissionError(exc.errno, exc.strerror, relative or ".") from None
    found.sort(key=lambda pair: pair[0])
    return found


def _subfolders(entries: list[tuple[str, os.stat_result]]) -> Iterator[str]:
    return iter([name for name, st in entries if stat.S_ISDIR(st.st_mode)])


def _open_listed_dir(parent: int, name: str, relative: str) -> int | None:
    """The subfolder ``name``, or None when it is no longer a folder (gone, or swapped)."""
    try:
        listed = os.stat(name, dir_fd=parent, follow_symlinks=False)
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except PermissionError as exc:
        raise PermissionError(exc.errno, exc.strerror, relative) from None
    except OSError:
        return None
    if not os.path.samestat(listed, os.fstat(fd)):
        os.close(fd)  # replaced between the listing and the open
        return None
    return fd


# --- the tree --------------------------------------------------------------------------------


class Tree:
    """A folder and everything below it, reached only through descriptors.

    ``owner`` (uid, gid), when given, owns every folder and file this tree
    creates or places (a job's user, when the agent runs as root); ``None``
    leaves them to the agent's own user.
    """

    def __init__(
        self, root: Path | str, *, owner: tuple[int, int] | None = None, fd: int | None = None
    ) -> None:
        self.path = Path(root)
        """Where the root is, for messages and for Docker's bind mounts: the root
        is the agent's own folder, and nothing below it is ever named this way."""
        self.owner = owner
        self.fd = (
            fd if fd is not None else os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        )

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Tree:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def subtree(self, parts: Sequence[str], *, create: bool = False) -> Tree:
        """The folder at ``parts`` as a tree of its own (the caller closes it)."""
        return Tree(
            self.path.joinpath(*parts), owner=self.owner, fd=self.open_dir(parts, create=create)
        )

    # --- single operations -------------------------------------------------------------

    def open_dir(self, parts: Sequence[str], *, create: bool = False, clear: bool = False) -> int:
        """A descriptor of the folder at ``parts``; ``create`` makes the missing ones,
        and ``clear`` first removes a file or a link (the link itself) in the way."""
        if not create:
            return open_beneath(self.fd, parts, _DIR_FLAGS)
        current = os.dup(self.fd)
        try:
            for part in parts:
                opened = self._child_dir(current, part, clear)
                os.close(current)
                current = opened
        except BaseException:
            os.close(current)
            raise
        return current

    def _child_dir(self, parent: int, name: str, clear: bool) -> int:
        try:
            return open_beneath(parent, (name,), _DIR_FLAGS)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR) and clear:
                os.unlink(name, dir_fd=parent)
            elif exc.errno != errno.ENOENT:
                raise
        try:
            os.mkdir(name, 0o755, dir_fd=parent)
        except FileExistsError:
            return open_beneath(parent, (name,), _DIR_FLAGS)  # someone else made it: a folder?
        fd = open_beneath(parent, (name,), _DIR_FLAGS)
        self.own(fd)
        return fd

    def own(self, fd: int) -> None:
        """Give an open file or folder to the tree's owner (a file about to be placed)."""
        if self.owner is not None:
            os.fchown(fd, *self.owner)

    @contextlib.contextmanager
    def parent(
        self, parts: Sequence[str], *, create: bool = False, clear: bool = False
    ) -> Iterator[tuple[int, str]]:
        """``(descriptor of the folder holding parts[-1], parts[-1])`` while in the block."""
        if not parts:
            raise IsADirectoryError(errno.EISDIR, "the folder itself", str(self.path))
        fd = self.open_dir(parts[:-1], create=create, clear=clear)
        try:
            yield fd, parts[-1]
        finally:
            os.close(fd)

    def lstat(self, parts: Sequence[str]) -> os.stat_result | None:
        """What is at ``parts`` (a link is reported as a link), or None when nothing is."""
        if not parts:
            return os.fstat(self.fd)
        try:
            with self.parent(parts) as (fd, name):
                return os.stat(name, dir_fd=fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def open_file(self, parts: Sequence[str]) -> int:
        """A regular file for reading; anything else (folder, pipe, link) is refused."""
        fd = open_beneath(self.fd, parts, _READ_FLAGS)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                kind = errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EPERM
                raise OSError(kind, "not a regular file", "/".join(parts))
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read_small(self, parts: Sequence[str], limit: int) -> bytes | None:
        """A regular file's bytes (at most ``limit``, else LimitError), None when absent."""
        try:
            fd = self.open_file(parts)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as handle:
            data = handle.read(limit + 1)
        if len(data) > limit:
            raise LimitError(f"{'/'.join(parts)} is larger than {limit} bytes")
        return data

    def place(
        self, source_dir: int, source: str, parts: Sequence[str], *, clear: bool = False
    ) -> None:
        """Rename ``source`` (in ``source_dir``, outside the tree) to ``parts``.

        The folders on the way are made when missing; a file or link already
        there is replaced (the link itself, never what it points to); a folder
        there is refused (``EISDIR``). With ``clear``, a folder there is removed
        first, and so is a file or link where a folder on the way must be.
        """
        with self.parent(parts, create=True, clear=clear) as (fd, name):
            pause_point("place", name)
            if clear:
                with contextlib.suppress(FileNotFoundError):
                    if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                        shutil.rmtree(name, dir_fd=fd)  # fd-based, never follows links
            # rename(2) replaces a file or a link itself, and refuses a folder (EISDIR).
            os.rename(source, name, src_dir_fd=source_dir, dst_dir_fd=fd)

    def place_tree(self, source_dir: int, source: str, parts: Sequence[str]) -> None:
        """Move the folder ``source`` to ``parts``: renamed when nothing is there,
        else merged (folders merge, anything else replaces what is in the way);
        ``()`` merges it into the root. Raises ``NotADirectoryError`` when a file
        or a link is where the folder goes."""
        if not parts:
            self._merge_from(source_dir, source, self.fd)
            return
        with self.parent(parts, create=True) as (fd, name):
            pause_point("merge", name)
            try:
                os.rename(source, name, src_dir_fd=source_dir, dst_dir_fd=fd)
                return
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                    raise
            try:
                into = open_beneath(fd, (name,), _DIR_FLAGS)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise NotADirectoryError(errno.ENOTDIR, "not a folder", name) from None
                raise
            try:
                self._merge_from(source_dir, source, into)
            finally:
                os.close(into)

    @staticmethod
    def _merge_from(source_dir: int, source: str, into: int) -> None:
        source_fd = open_beneath(source_dir, (source,), _DIR_FLAGS)
        try:
            _merge(source_fd, into, 0)
        finally:
            os.close(source_fd)

    def unlink(self, parts: Sequence[str]) -> bool:
        """Remove the file or link at ``parts`` (never a folder); whether one was there."""
        try:
            with self.parent(parts) as (fd, name):
                pause_point("unlink", name)
                os.unlink(name, dir_fd=fd)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return False
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EISDIR, errno.EPERM):
                return False
            raise
        return True

    def prune_empty(self, parts: Sequence[str], stop: int) -> None:
        """Remove the folders of ``parts[:-1]`` that are empty, deepest first,
        keeping the first ``stop`` components."""
        for end in range(len(parts) - 1, stop, -1):
            try:
                with self.parent(parts[:end]) as (fd, name):
                    os.rmdir(name, dir_fd=fd)
            except OSError:
                return

    def walk(self, parts: Sequence[str] = ()) -> Iterator[Folder]:
        """Every folder from ``parts`` down (see :class:`Folder`), links never followed.

        A folder swapped while it is walked is either walked as it was when
        opened (wherever it moved inside the tree) or skipped. Raises
        ``LimitError`` past :data:`MAX_DEPTH` levels.
        """
        start = self.open_dir(parts)
        try:
            yield from _walk(start, "/".join(parts))
        finally:
            os.close(start)

    def chown_all(self, parts: Sequence[str], owner: tuple[int, int]) -> None:
        """Give every folder and file from ``parts`` down to ``owner`` (links themselves),
        with at least read and write for it (and search, for folders)."""
        for folder in self.walk(parts):
            _chown_fd(folder.fd, owner, 0o700)
            for name, st in folder.entries:
                if stat.S_ISDIR(st.st_mode):
                    continue  # owned when it is walked itself
                pause_point("chown", name)
                if stat.S_ISREG(st.st_mode):
                    _chown_file(folder.fd, name, st, owner)
                elif stat.S_ISLNK(st.st_mode):
                    with contextlib.suppress(OSError):
                        os.chown(name, *owner, dir_fd=folder.fd, follow_symlinks=False)

    def tally(
        self,
        listing: tuple[Sequence[str], dict[str, tuple[int, int]]] | None = None,
        stop: threading.Event | None = None,
    ) -> int:
        """Bytes in regular files in the whole tree, in one walk.

        With ``listing`` (a folder's parts, and a dict), the dict also gets each
        regular file under that folder: path from it -> (size, mtime_ns). Once
        ``stop`` is set the walk ends at the next entry, raising :class:`WalkStopped`.
        """
        total = 0
        base = "/".join(listing[0]) if listing is not None else ""
        for folder in self.walk():
            below = _below(folder.relative, base) if listing is not None else None
            _check_stop(stop)
            for name, st in folder.entries:
                _check_stop(stop)
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
                    if below is not None and listing is not None:
                        path = f"{below}/{name}" if below else name
                        listing[1][path] = (st.st_size, st.st_mtime_ns)
        return total


class WalkStopped(Exception):
    """A walk was stopped (its ``stop`` event set) before it ended."""


def _check_stop(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise WalkStopped


def _below(path: str, base: str) -> str | None:
    """``path`` seen from ``base`` when it is ``base`` or below it (``""``: base itself)."""
    if not base or path == base:
        return path[len(base) :].lstrip("/")
    if path.startswith(base + "/"):
        return path[len(base) + 1 :]
    return None


def _chown_fd(fd: int, owner: tuple[int, int], mode_or: int) -> None:
    st = os.fstat(fd)
    if (st.st_uid, st.st_gid) != owner:
        os.fchown(fd, *owner)
    mode = stat.S_IMODE(st.st_mode)
    if mode | mode_or != mode:
        os.fchmod(fd, mode | mode_or)


def _chown_file(folder: int, name: str, listed: os.stat_result, owner: tuple[int, int]) -> None:
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=folder)
    except OSError:
        return  # gone or swapped for a link: nothing of ours to change
    try:
        if os.path.samestat(listed, os.fstat(fd)):
            _chown_fd(fd, owner, 0o600)
    finally:
        os.close(fd)


def _merge(source: int, dest: int, depth: int) -> None:
    """Move ``source``'s entries into ``dest``: folders merge, anything else replaces."""
    if depth > MAX_DEPTH:
        raise _too_deep()
    for name, st in list_entries(source, ""):
        pause_point("merge", name)
        try:
            there = os.stat(name, dir_fd=dest, follow_symlinks=False)
        except FileNotFoundError:
            there = None
        if stat.S_ISDIR(st.st_mode) and there is not None and stat.S_ISDIR(there.st_mode):
            sub_source = open_beneath(source, (name,), _DIR_FLAGS)
            try:
                sub_dest = open_beneath(dest, (name,), _DIR_FLAGS)
                try:
                    _merge(sub_source, sub_dest, depth + 1)
                finally:
                    os.close(sub_dest)
            finally:
                os.close(sub_source)
            continue
        if there is not None and stat.S_ISDIR(there.st_mode):
            shutil.rmtree(name, dir_fd=dest)  # fd-based, never follows links (3.11+)
        elif there is not None and stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=dest)  # rename cannot put a folder over a file
        os.rename(name, name, src_dir_fd=source, dst_dir_fd=dest)
