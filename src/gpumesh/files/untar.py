"""Unpacking an uploaded tar: the receiving end of every folder, workdir and app sync.

The archive came from another machine, so it is treated as hostile: it is
either extracted whole inside a fresh private folder (renamed to its
destination at the end) or nothing is left. GPUMesh's own checks come first
and are stricter than tarfile's ``data`` filter: no absolute names, no ``..``
anywhere, no entry twice (folders excepted), nothing written inside a symlink
or a file, symlinks whose text stays inside, hard links only to files already
extracted, no devices, pipes or sparse files, and the sum of file sizes within
the limit before a byte of content is written.

Why not :mod:`tarfile`: its extraction costs about 0.2 ms of interpreter time
per entry (a ``realpath`` for each, several ``stat`` calls, path joins), which
is most of the time of a 10,000-file folder. Here the headers are parsed in
place from the pieces as they arrive, files are created relative to open
folder descriptors (``O_EXCL | O_NOFOLLOW``: never through a link, never over
something already there), and content is written straight from the arriving
pieces with no copy. The formats read are what :func:`gpumesh.files.pack.write_tar`
writes (POSIX ustar with pax extended headers) and what other tar tools
commonly write (GNU long names, V7 folders); anything else is refused.

Modes follow tarfile's ``data`` filter: files keep their exec bits, less
set-id, sticky and group/other write, and their owner can always read and
write them; folders keep theirs the same way, and their owner keeps full
access so the folder can be replaced or removed later. Modification times
are kept for files and folders (not symlinks); owners never travel. The
provider may name an owner: everything made (the top folder included) is
given to it as it is made, through the descriptor in hand, so no second walk
over the unpacked folder is needed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from gpumesh import platform
from gpumesh.errors import AgentError, GPUMeshError, LimitError, ProtocolError
from gpumesh.units import format_size

__all__ = ["inside", "text_stays_inside", "unpack_stream", "unpack_tar"]

_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
_READ = 64 * 1024
"""Bytes read at a time from a file-like source (never past the limit)."""
MAX_META_SIZE = 1 << 20
"""Largest pax or GNU long-name header accepted: it is held in memory whole, so a
hostile archive could otherwise claim gigabytes."""
_OPEN_DIRS = 64
"""Folder descriptors kept open at once (a deep or wide tree reopens the rest)."""
_SIGNED = struct.Struct("148b8x356b")

_FILE_TYPES = frozenset({b"0", b"\0", b"7"})
_META_TYPES = frozenset({b"x", b"g", b"X", b"L", b"K"})
_OTHER_KINDS = {b"5": "dir", b"2": "symlink", b"1": "hard link"}
_REFUSED_KINDS = {b"3": "is a device", b"4": "is a device", b"6": "is a named pipe"}
# getattr: a consumer on Windows imports this module (through pack.py); it has
# none of these, and unpacks by path (_PathWriter) in a fresh private folder,
# as does any system missing one of them.
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | getattr(os, "O_BINARY", 0)

Piece = bytes | bytearray | memoryview


class _Incomplete(Exception):
    """The bytes are not (or stop being) a tar archive; the text says how."""


@dataclass(slots=True)
class _Member:
    name: str
    type: bytes
    size: int
    mode: int
    mtime: float
    linkname: str
    sparse: bool = False


# --- the bytes --------------------------------------------------------------------------


class _Source:
    """The archive's bytes from ``next_piece`` (None: the end), counted against ``limit``."""

    def __init__(self, next_piece: Callable[[], Piece | None], limit: int) -> None:
        self._next_piece = next_piece
        self._limit = limit
        self._view = memoryview(b"")
        self.count = 0

    def _fill(self) -> bool:
        while not self._view:
            piece = self._next_piece()
            if piece is None:
                return False
            self._view = memoryview(piece).cast("B")
            self.count += len(self._view)
            if self.count > self._limit:
                raise over_limit(self._limit)
        return True

    def take(self, size: int) -> bytes | None:
        """Exactly ``size`` bytes; None when the archive ended before the first."""
        view = self._view
        if len(view) >= size:
            self._view = view[size:]
            return bytes(view[:size])
        gathered = bytearray()
        while len(gathered) < size:
            if not self._fill():
                if not gathered:
                    return None
                raise _Incomplete("unexpected end of data")
            step = size - len(gathered)
            gathered += self._view[:step]
            self._view = self._view[step:]
        return bytes(gathered)

    def copy_to(self, fd: int, size: int) -> None:
        """Write the next ``size`` bytes to ``fd`` straight from the pieces."""
        while size:
            if not self._fill():
                raise _Incomplete("unexpected end of data")
            view = self._view[:size]
            self._view = self._view[len(view) :]
            size -= len(view)
            platform.write_all(fd, view)

    def skip(self, size: int) -> None:
        while size:
            if not self._fill():
                raise _Incomplete("unexpected end of data")
            step = min(size, len(self._view))
            self._view = self._view[step:]
            size -= step

    def drain(self) -> None:
        """Read to the end (a tar writer pads after its end marker)."""
        self._view = memoryview(b"")
        while self._fill():
            self._view = memoryview(b"")


def _number(field: bytes) -> int:
    if field[:1] == b"\x80":  # base-256, for numbers octal cannot hold
        return int.from_bytes(field[1:], "big")
    if field[:1] == b"\xff":
        raise _Incomplete("a negative number in a header")
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise _Incomplete("invalid header") from None


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _padding(size: int) -> int:
    return -size % _BLOCK


def _checksum_ok(block: bytes) -> bool:
    stored = _number(block[148:156])
    unsigned = 256 + sum(block) - sum(block[148:156])
    return stored == unsigned or stored == 256 + sum(_SIGNED.unpack_from(block))


def _pax(data: bytes) -> dict[str, str]:
    records: dict[str, str] = {}
    position = 0
    while position < len(data):
        if data[position] == 0:  # some writers pad the record list with NULs
            break
        length_text, space, _ = data[position : position + 20].partition(b" ")
        if not space or not length_text.isdigit() or int(length_text) < len(length_text) + 3:
            raise _Incomplete("invalid pax header")
        end = position + int(length_text)
        record = data[position + len(length_text) + 1 : end]
        if end > len(data) or not record.endswith(b"\n") or b"=" not in record:
            raise _Incomplete("invalid pax header")
        key, _, value = record[:-1].partition(b"=")
        records[key.decode("utf-8", "replace")] = value.decode("utf-8", "surrogateescape")
        position = end
    return records


def _next_member(source: _Source) -> _Member | None:
    """The next entry with its pax and long-name headers applied; None at the end."""
    long_name: str | None = None
    long_link: str | None = None
    pax: dict[str, str] = {}
    first = True
    while True:
        block = source.take(_BLOCK)
        if block is None:
            if first:
                raise _Incomplete("empty file" if source.count == 0 else "no end-of-archive marker")
            raise _Incomplete("unexpected end of data")
        if block == _ZERO_BLOCK:
            if not first:
                raise _Incomplete("an extended header with no entry after it")
            return None
        first = False
        if not _checksum_ok(block):
            raise _Incomplete("bad checksum")
        kind = block[156:157]
        size = _number(block[124:136])
        if kind in _META_TYPES:
            if size > MAX_META_SIZE:
                raise ProtocolError(
                    f"refused the upload: a {format_size(size)} tar header; "
                    "it was not made by gpumesh"
                )
            data = source.take(size + _padding(size)) if size else b""
            if data is None:
                raise _Incomplete("unexpected end of data")
            data = data[:size]
            if kind == b"L":
                long_name = _text(data)
            elif kind == b"K":
                long_link = _text(data)
            elif kind in (b"x", b"X"):
                pax.update(_pax(data))
            # b"g" (global headers) set nothing GPUMesh keeps.
            continue
        name = _text(block[0:100])
        prefix = _text(block[345:500])
        if prefix and kind != b"S":
            name = f"{prefix}/{name}"
        if kind == b"\0" and name.endswith("/"):
            kind = b"5"  # a V7 folder
        member = _Member(
            name=long_name if long_name is not None else name,
            type=kind,
            size=size,
            mode=_number(block[100:108]),
            mtime=_number(block[136:148]),
            linkname=long_link if long_link is not None else _text(block[157:257]),
            sparse=kind == b"S",
        )
        if pax:
            _apply_pax(member, pax)
        return member


def _apply_pax(member: _Member, pax: dict[str, str]) -> None:
    try:
        if "path" in pax:
            member.name = pax["path"]
        if "linkpath" in pax:
            member.linkname = pax["linkpath"]
        if "size" in pax:
            member.size = int(pax["size"])
        if "mtime" in pax:
            member.mtime = float(pax["mtime"])
    except ValueError:
        raise _Incomplete("invalid pax header") from None
    if member.size < 0:
        raise _Incomplete("invalid pax header")
    if any(key.startswith("GNU.sparse.") for key in pax):
        member.sparse = True


# --- the checks -------------------------------------------------------------------------


def over_limit(limit: int) -> LimitError:
    return LimitError(
        f"the upload is larger than this provider's limit of {format_size(limit)}; "
        "leave big files out with .gpumeshignore, or ask the provider for a higher limit"
    )


def _refuse(member: _Member, why: str) -> ProtocolError:
    return ProtocolError(f"refused the upload: entry {member.name!r} {why}")


def _kind(member: _Member) -> str:
    kind = member.type
    if kind in _FILE_TYPES or kind == b"S":
        if member.sparse:
            raise _refuse(member, "is a sparse file; gpumesh never sends those")
        return "file"
    if kind in _OTHER_KINDS:
        return _OTHER_KINDS[kind]
    raise _refuse(member, _REFUSED_KINDS.get(kind, f"has an unsupported type {kind!r}"))


def text_stays_inside(depth: int, target: str) -> bool:
    """Whether a link's text alone stays inside a folder, read from ``depth``
    folders below it: a relative target that never climbs above the folder."""
    if not target or os.path.isabs(target):
        return False
    for part in target.split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                return False
        elif part not in ("", "."):
            depth += 1
    return True


def _file_mode(mode: int) -> int:
    """tarfile's ``data`` filter for a file's mode."""
    mode &= 0o755
    if not mode & 0o100:
        mode &= ~0o111
    return mode | 0o600


# --- writing ----------------------------------------------------------------------------


class _FdWriter:
    """Creates entries below ``root_fd`` (a fresh folder private to this process),
    each relative to its open parent folder, never through a link."""

    def __init__(
        self, root_fd: int, owner: tuple[int, int] | None = None, dropped: int = 0o777
    ) -> None:
        self._owner = owner
        self._dropped = dropped
        """Mode bits a create may leave out (see :func:`_dropped_at_create`)."""
        if owner is not None:
            os.fchown(root_fd, *owner)
        self._dirs: dict[str, int] = {"": root_fd}
        self._made: set[str] = set()
        """Folders made here: reopened after :meth:`trim` without trying mkdir again."""
        self.folders: dict[str, tuple[int, float]] = {}
        """Folders with a header: their mode and time, set once everything is in."""

    def folder(self, path: str) -> int:
        """The descriptor of folder ``path`` (made on first use)."""
        fd = self._dirs.get(path)
        if fd is not None:
            return fd
        parent, _, name = path.rpartition("/")
        parent_fd = self.folder(parent)
        made = path not in self._made
        if made:
            try:
                os.mkdir(name, 0o777, dir_fd=parent_fd)
            except FileExistsError:  # made before (a folder twice)
                made = False
            self._made.add(path)
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        self._dirs[path] = fd
        if made and self._owner is not None:
            os.fchown(fd, *self._owner)
        return fd

    def trim(self) -> None:
        """Close the folders kept open when there are many (between entries, so no
        descriptor in use is closed)."""
        if len(self._dirs) > _OPEN_DIRS:
            self._close_folders()

    def file(self, source: _Source, path: str, member: _Member) -> None:
        parent, _, name = path.rpartition("/")
        # Made with its final mode: one fchmod less per file, unless the create
        # leaves some of its bits out (the umask, a default ACL).
        mode = _file_mode(member.mode)
        fd = os.open(name, _FILE_FLAGS, mode, dir_fd=self.folder(parent))
        try:
            source.copy_to(fd, member.size)
            if self._owner is not None:
                os.fchown(fd, *self._owner)
            if mode & self._dropped:
                os.fchmod(fd, mode)
            os.utime(fd, (member.mtime, member.mtime))
        finally:
            os.close(fd)

    def symlink(self, path: str, target: str) -> None:
        parent, _, name = path.rpartition("/")
        parent_fd = self.folder(parent)
        os.symlink(target, name, dir_fd=parent_fd)
        if self._owner is not None:
            os.chown(name, *self._owner, dir_fd=parent_fd, follow_symlinks=False)

    def hard_link(self, path: str, target: str, member: _Member) -> None:
        parent, _, name = path.rpartition("/")
        target_parent, _, target_name = target.rpartition("/")
        dest_fd = self.folder(parent)
        os.link(
            target_name,
            name,
            src_dir_fd=self.folder(target_parent),
            dst_dir_fd=dest_fd,
            follow_symlinks=False,
        )
        fd = os.open(name, os.O_RDONLY | _NOFOLLOW, dir_fd=dest_fd)
        try:
            os.fchmod(fd, _file_mode(member.mode))
            os.utime(fd, (member.mtime, member.mtime))
        finally:
            os.close(fd)

    def finish_folders(self) -> None:
        # Deepest first, so setting a folder's time is not undone by its subfolders.
        for path in sorted(self.folders, key=lambda p: p.count("/"), reverse=True):
            mode, mtime = self.folders[path]
            self.trim()
            fd = self.folder(path)
            os.fchmod(fd, (mode & 0o755) | 0o700)
            os.utime(fd, (mtime, mtime))

    def _close_folders(self) -> None:
        root_fd = self._dirs[""]
        for path, fd in self._dirs.items():
            if path:
                os.close(fd)
        self._dirs = {"": root_fd}

    def close(self) -> None:
        self._close_folders()
        os.close(self._dirs.pop(""))


class _PathWriter:
    """:class:`_FdWriter` by path, where the OS has no descriptor-relative calls or
    no ``O_NOFOLLOW`` (Windows): the staging folder is fresh and private to this process, and
    every entry's parents were checked to be folders made here."""

    def __init__(self, root: str, owner: tuple[int, int] | None = None) -> None:
        self._root = root
        self._owner = owner
        self._own(root)
        self._flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | platform.BINARY
        self._flags |= platform.open_flag("O_NOFOLLOW") | platform.open_flag("O_CLOEXEC")
        self._made = {""}
        self.folders: dict[str, tuple[int, float]] = {}

    def _full(self, path: str) -> str:
        return os.path.join(self._root, *path.split("/"))

    def _own(self, full: str) -> None:
        if self._owner is not None:
            os.chown(full, *self._owner, follow_symlinks=False)

    def folder(self, path: str) -> None:
        if path in self._made:
            return
        self.folder(path.rpartition("/")[0])
        with contextlib.suppress(FileExistsError):
            os.mkdir(self._full(path))
            self._own(self._full(path))  # only a folder made here
        self._made.add(path)

    def trim(self) -> None:
        return None

    def file(self, source: _Source, path: str, member: _Member) -> None:
        self.folder(path.rpartition("/")[0])
        full = self._full(path)
        fd = os.open(full, self._flags, 0o600)
        try:
            source.copy_to(fd, member.size)
        finally:
            os.close(fd)
        self._own(full)
        os.chmod(full, _file_mode(member.mode))
        os.utime(full, (member.mtime, member.mtime))

    def symlink(self, path: str, target: str) -> None:
        self.folder(path.rpartition("/")[0])
        os.symlink(target, self._full(path))
        self._own(self._full(path))

    def hard_link(self, path: str, target: str, member: _Member) -> None:
        self.folder(path.rpartition("/")[0])
        os.link(self._full(target), self._full(path))
        os.chmod(self._full(path), _file_mode(member.mode))
        os.utime(self._full(path), (member.mtime, member.mtime))

    def finish_folders(self) -> None:
        for path in sorted(self.folders, key=lambda p: p.count("/"), reverse=True):
            mode, mtime = self.folders[path]
            os.chmod(self._full(path), (mode & 0o755) | 0o700)
            os.utime(self._full(path), (mtime, mtime))

    def close(self) -> None:
        return None


def _extract(source: _Source, writer: _FdWriter | _PathWriter, limit: int) -> tuple[int, list[str]]:
    """Every entry of the archive into ``writer``; (bytes of content, symlinks made)."""
    kinds: dict[str, str] = {}
    symlinks: list[str] = []
    content = 0
    while (member := _next_member(source)) is not None:
        name = member.name
        if name.startswith("/") or os.path.isabs(name):
            raise _refuse(member, "has an absolute path")
        raw_parts = name.split("/")
        if ".." in raw_parts:
            raise _refuse(member, "climbs out with '..'")
        parts = [part for part in raw_parts if part not in ("", ".")]
        kind = _kind(member)
        skip = member.size + _padding(member.size) if kind == "file" else 0
        if not parts:  # the archive's own "./": the destination itself
            source.skip(skip)
            continue
        path = "/".join(parts)
        writer.trim()
        for depth in range(1, len(parts)):
            parent = "/".join(parts[:depth])
            parent_kind = kinds.setdefault(parent, "dir")
            if parent_kind != "dir":
                raise _refuse(member, f"is inside {parent!r}, which is a {parent_kind}")
        previous = kinds.get(path)
        if previous is not None and not (previous == kind == "dir"):
            raise _refuse(member, "appears twice")
        kinds[path] = kind
        if kind == "file":
            content += member.size
            if content > limit:
                raise over_limit(limit)
            writer.file(source, path, member)
            source.skip(_padding(member.size))
        elif kind == "dir":
            writer.folder(path)
            writer.folders[path] = (member.mode, member.mtime)
        elif kind == "symlink":
            target = member.linkname  # its text, resolved from where it is
            if target.startswith("/") or not text_stays_inside(len(parts) - 1, target):
                raise _refuse(member, f"is a symlink to {target!r}, outside the folder")
            writer.symlink(path, member.linkname)
            symlinks.append(path)
        else:
            target = "/".join(p for p in member.linkname.split("/") if p not in ("", "."))
            if (
                member.linkname.startswith("/")
                or ".." in member.linkname.split("/")
                or kinds.get(target) != "file"
            ):
                raise _refuse(member, "is a hard link to something not extracted before it")
            writer.hard_link(path, target, member)
    writer.finish_folders()
    return content, symlinks


def unpack_stream(
    next_piece: Callable[[], Piece | None],
    dest: Path,
    limit: int,
    owner: tuple[int, int] | None = None,
) -> int:
    """Extract the tar arriving as pieces from ``next_piece`` (None: the end) into
    ``dest`` (absent or an empty folder); returns bytes of content.

    All or nothing: extraction happens in a sibling temporary folder renamed to
    ``dest`` at the end. Refuses (``ProtocolError``) anything unsafe (see the
    module's docstring) and anything that is not a whole tar; refuses
    (``LimitError``) more than ``limit`` bytes of archive or of file content.
    Reads every piece to the end, past the archive's end marker.
    A piece may be reused by its producer once the next one is asked for.
    ``owner`` (uid, gid): given every folder, file and link made, ``dest`` included.
    """
    if dest.is_symlink() or (dest.exists() and (not dest.is_dir() or any(dest.iterdir()))):
        raise FileExistsError(f"{dest} is not an empty folder")
    dest.parent.mkdir(parents=True, exist_ok=True)
    temp = dest.parent / f".{dest.name}.unpacking-{secrets.token_hex(6)}"
    temp.mkdir()  # mode 0o777 less the umask, like the folders made inside
    try:
        source = _Source(next_piece, limit)
        writer: _FdWriter | _PathWriter
        if platform.has("dir_fd") and platform.has("nofollow") and platform.has("oflags"):
            root_fd = os.open(temp, _DIR_FLAGS)
            try:
                writer = _FdWriter(root_fd, owner, _dropped_at_create(root_fd))
            except BaseException:
                os.close(root_fd)
                raise
        else:
            writer = _PathWriter(str(temp), owner)
        try:
            content, symlinks = _extract(source, writer, limit)
            source.drain()
        except _Incomplete as exc:
            raise ProtocolError(f"refused the upload: not a complete tar archive ({exc})") from None
        except GPUMeshError:
            raise
        except OSError as exc:
            raise _write_failed(exc) from None
        finally:
            writer.close()
        _check_links(temp, symlinks)
        temp.rename(dest)  # replaces dest when it is an empty folder
    except BaseException:
        with contextlib.suppress(OSError):
            shutil.rmtree(temp)
        raise
    return content


def unpack_tar(
    src: BinaryIO | Path, dest: Path, limit: int, owner: tuple[int, int] | None = None
) -> int:
    """:func:`unpack_stream` of a file (read once, as a stream) or of the file at a path."""
    if isinstance(src, Path):
        with src.open("rb") as opened:
            return unpack_tar(opened, dest, limit, owner)
    taken = 0

    def next_piece() -> bytes | None:
        nonlocal taken
        # Never more than one byte past the limit, so an archive over it stops early.
        data = src.read(max(1, min(_READ, limit + 1 - taken)))
        taken += len(data)
        return data or None

    return unpack_stream(next_piece, dest, limit, owner)


def _dropped_at_create(root_fd: int) -> int:
    """The mode bits a file created below ``root_fd`` may not get from its create call:
    the umask, read without changing it (``os.umask`` would, for every thread);
    all of them when ``root_fd`` has a default ACL (which then decides, and which
    every folder made below it inherits) or when this cannot be told."""
    try:
        if "system.posix_acl_default" in os.listxattr(root_fd):
            return 0o777
    except OSError as exc:
        if exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return 0o777
    except AttributeError:  # no xattrs on this system
        return 0o777
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o777


def _write_failed(exc: OSError) -> GPUMeshError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return LimitError("the provider's disk is full: it has no room for this upload")
    return AgentError(f"the provider could not write the upload: {exc.strerror or exc}")


def inside(path: str, root: str) -> bool:
    """Whether the real path ``path`` is ``root`` or below it."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _check_links(root: Path, symlinks: list[str]) -> None:
    # Each link was checked when it was made, but a later link can change
    # where an earlier one leads (a -> b/.., then b -> .): check them all again.
    real_root = os.path.realpath(root)
    for link in symlinks:
        if not inside(os.path.realpath(root / link), real_root):
            raise ProtocolError(f"refused the upload: symlink {link!r} leads outside the folder")
