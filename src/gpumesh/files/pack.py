"""Packing a job's working folder for upload, and unpacking it safely on the provider.

This module owns the upload format and both of its ends:

* :func:`scan` decides what is sent: every file, folder and symlink under the
  folder, minus what ``.gpumeshignore`` (gitignore syntax) and the built-in
  defaults leave out, with the reason for each entry left out.
* :func:`write_tar` streams that plan as an uncompressed POSIX (pax) tar with
  constant memory, and :func:`tar_size` tells its exact size beforehand, so the
  provider can refuse an upload over its limit before a byte is sent.
* :func:`unpack_tar` (from :mod:`gpumesh.files.untar`) is the receiving side:
  it treats the archive as hostile (it came from another machine) and either
  extracts all of it inside the destination or leaves nothing behind.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import tarfile
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Literal, NamedTuple, Protocol, cast

import pathspec

from gpumesh import platform
from gpumesh.errors import ConfigError, LimitError
from gpumesh.files.sandbox import (
    MAX_DEPTH,
    Folder,
    Tree,
    list_entries,
    open_beneath,
    pause_point,
)
from gpumesh.files.untar import inside, text_stays_inside, unpack_tar
from gpumesh.files.watch import open_watch
from gpumesh.units import format_size

if TYPE_CHECKING:
    from gpumesh.files.watch import FolderWatch

__all__ = [
    "DEFAULT_IGNORES",
    "IGNORE_FILE",
    "Gathering",
    "PackEntry",
    "PackPlan",
    "ScanMemo",
    "Skipped",
    "scan",
    "scan_tree",
    "tar_size",
    "unpack_tar",
    "write_tar",
]

IGNORE_FILE = ".gpumeshignore"
DEFAULT_IGNORES = (
    ".git/",
    ".venv/",
    "venv/",
    "__pycache__/",
    "node_modules/",
    ".gpumesh/",
    "*.pyc",
)
"""Applied before the user's ``.gpumeshignore``, which can re-include with ``!pattern``."""
DEFAULTS_REGEX = (
    r"(?:^(?:.+/)?\.git(?:/))|(?:^(?:.+/)?\.venv(?:/))|(?:^(?:.+/)?venv(?:/))"
    r"|(?:^(?:.+/)?__pycache__(?:/))|(?:^(?:.+/)?node_modules(?:/))"
    r"|(?:^(?:.+/)?\.gpumesh(?:/))|(?:^(?:.+/)?[^/]*\.pyc(?:(?:/)|$))"
)
"""What pathspec makes of :data:`DEFAULT_IGNORES`, as one regex (a test keeps it
equal): a folder without a ``.gpumeshignore`` is matched with it, and pathspec's
rules are compiled only when one of its paths matches."""

_BLOCK = tarfile.BLOCKSIZE
_END_OF_ARCHIVE = b"\0" * (2 * _BLOCK)
_CHUNK = 1 << 20
"""Bytes read from a file, and handed to ``out.write``, at a time."""
_MAX_IGNORE_FILE = 1 << 20
"""Largest ``.gpumeshignore`` read (a provider reads one its peer's jobs may write)."""
_SPECIAL_KINDS = {
    stat.S_IFSOCK: "a socket",
    stat.S_IFIFO: "a named pipe",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}

EntryKind = Literal["file", "dir", "symlink"]


@dataclass(frozen=True, slots=True)  # slots: half the cost of making 10,000 of them
class PackEntry:
    """One thing put in the archive."""

    path: str
    """Relative to the packed folder, ``/``-separated, no trailing slash."""
    kind: EntryKind
    size: int
    """Bytes of content; 0 for folders and symlinks."""
    mode: int
    """Permission bits (``0o755``); set-id and sticky bits are never packed."""
    mtime: int
    """Modification time, whole seconds since the epoch."""
    target: str = ""
    """A symlink's target, always relative and inside the folder."""
    mtime_ns: int = 0
    """A file's modification time in nanoseconds, as scanned (for hash caches)."""


@dataclass(frozen=True)
class Skipped:
    """One thing left out, and why (for ``--dry-run``)."""

    path: str
    """Relative to the packed folder; folders end with ``/``."""
    reason: str
    """The rule that left it out, e.g. ``.gpumeshignore:3 'data/'``."""


@dataclass(frozen=True)
class PackPlan:
    """What :func:`write_tar` will send, decided by :func:`scan`."""

    root: Path
    """The packed folder, symlinks resolved."""
    files: tuple[PackEntry, ...]
    """Every entry packed (files, folders and symlinks), each folder before its contents."""
    skipped: tuple[Skipped, ...]
    root_fd: int | None = None
    """A provider's plan: the descriptor of the scanned folder (open while the
    tree it came from is), through which files are opened again when packed;
    ``None``: files are opened by their path under ``root``."""

    @property
    def total_bytes(self) -> int:
        """Bytes of file content (the tar adds headers: see :func:`tar_size`)."""
        return sum(entry.size for entry in self.files)


# --- ignore rules --------------------------------------------------------------------------------


class _IgnoreRules:
    """The defaults followed by the user's ``.gpumeshignore``, last match wins."""

    def __init__(self, user_lines: list[str]) -> None:
        self.lines = tuple(user_lines)
        """The ignore file's lines: equal lines, equal decisions."""
        self._why: list[str] = []
        self._sources = [("default rule", line) for line in DEFAULT_IGNORES]
        self._sources += [
            (f"{IGNORE_FILE}:{number}", line) for number, line in enumerate(user_lines, start=1)
        ]
        self._spec: pathspec.GitIgnoreSpec | None = None
        self._any: re.Pattern[str] | None
        if any(line.strip() and not line.startswith("#") for line in user_lines):
            self._compile()  # checks the user's lines now: a bad one is an error at once
        else:
            self._any = re.compile(DEFAULTS_REGEX)

    def _compile(self) -> pathspec.GitIgnoreSpec:
        patterns = []
        self._why = []
        for where, line in self._sources:
            if not line.strip() or line.startswith("#"):
                continue
            try:
                compiled = pathspec.GitIgnoreSpec.from_lines([line]).patterns
            except ValueError:
                compiled = []
            # pathspec gives no pattern (or include None) for lines git could
            # never match, such as an unclosed "[": say so rather than ignore them.
            if len(compiled) != 1 or compiled[0].include is None:
                raise ConfigError(
                    f"{where}: invalid pattern {line!r}; "
                    "fix or remove it (the syntax is .gitignore's)"
                )
            patterns.append(compiled[0])
            self._why.append(f"{where} {line.strip()!r}")
        # Built from the patterns one by one, so a match's index is its rule.
        self._spec = pathspec.GitIgnoreSpec(patterns)
        self._any = _any_of(patterns)
        return self._spec

    @classmethod
    def load(cls, tree: Tree | Path) -> _IgnoreRules:
        """The rules of ``tree``'s ignore file (a :class:`Path`: read by path)."""
        root = tree.path if isinstance(tree, Tree) else tree
        try:
            if isinstance(tree, Tree):
                data = tree.read_small((IGNORE_FILE,), _MAX_IGNORE_FILE)
            else:
                data = _read_small(tree / IGNORE_FILE, _MAX_IGNORE_FILE)
        except LimitError:
            raise ConfigError(
                f"{IGNORE_FILE} is larger than {format_size(_MAX_IGNORE_FILE)}; shorten it"
            ) from None
        except OSError as exc:
            raise ConfigError(f"cannot read {root / IGNORE_FILE}: {exc.strerror}") from None
        if data is None:
            return cls([])
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"{IGNORE_FILE} is not UTF-8 text; save it as UTF-8") from None
        return cls(text.splitlines())

    def why_ignored(self, relative: str) -> str | None:
        """The rule that leaves ``relative`` out (folders end with ``/``), or None."""
        if self._any is not None and self._any.search(relative) is None:
            return None  # no rule matches it at all: the common case, in one search
        spec = self._spec or self._compile()
        result = spec.check_file(relative)
        if result.include and result.index is not None:
            return self._why[result.index]
        return None


_NAMED_GROUP = re.compile(r"\(\?P<\w+>")


def _any_of(patterns: Iterable[pathspec.Pattern]) -> re.Pattern[str] | None:
    """One regex that matches a path when any of ``patterns`` does, or None when
    the patterns are not plain regexes with the same flags (then each is tried).

    Which rule wins still takes pathspec's own check; this only answers "none
    matches" for most paths with one search instead of one per rule. The paths
    given are already normalized (relative, ``/``-separated), so searching them
    directly is what pathspec does.
    """
    sources = []
    flags: set[int] = {re.UNICODE}
    for pattern in patterns:
        regex = getattr(pattern, "regex", None)
        if not isinstance(regex, re.Pattern) or not isinstance(regex.pattern, str):
            return None
        flags.add(regex.flags)
        # Named groups (the folder mark) may repeat across rules; the union needs none.
        sources.append(f"(?:{_NAMED_GROUP.sub('(?:', regex.pattern)})")
    if len(flags) != 1:
        return None
    try:
        return re.compile("|".join(sources) or "(?!)")
    except re.error:
        return None


# --- scanning ------------------------------------------------------------------------------------


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes in a name, kept by os as surrogates
        return False
    return True


def _link_target(root: str, relative: str, full: str) -> str | None:
    """How to store the symlink at ``relative``: a relative target inside the
    folder, or None when it leads outside (it would not exist on the provider,
    or would point at the provider's own files)."""
    target = os.readlink(full)
    real = os.path.realpath(full)
    if not inside(real, root):
        return None
    parent = os.path.dirname(relative)
    if not os.path.isabs(target):
        lexical = os.path.normpath(os.path.join(parent, target))
        if lexical != ".." and not lexical.startswith("../"):
            return target
    # Absolute, or climbing out and back in: rewrite it relative to its folder.
    return os.path.relpath(real, os.path.join(root, parent))


def _read_small(path: Path, limit: int) -> bytes | None:
    """:meth:`Tree.read_small` by path: None when absent, never through a link."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise OSError(errno.ELOOP, "a symlink", str(path))
    with open(path, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise LimitError(f"{path} is larger than {format_size(limit)}")
    return data


class ScanMemo:
    """What one :func:`scan` of a folder decided for its regular files, for the
    next scan of the same folder (``app sync`` re-syncs from a long-lived process).

    A file listed again with the same size, mode and mtime_ns, under the same
    ignore rules, gets the same entry: it is reused rather than decided again
    (the decision depends on nothing else). Everything else is decided afresh.
    Each scan publishes a new mapping, so a memo may be shared between threads.

    With ``watch`` (a long-lived process's memo), the kernel is asked to tell
    of changes in the folder's subfolders (:mod:`gpumesh.files.watch`, Linux):
    the next scan lists again only the folders something changed in (and
    their parents), and takes the others' decisions from the last scan
    without a system call. Where no such notice can be had, or a notice says
    the folders themselves moved, every folder is listed as without it.
    Watched scans of one folder take turns.
    """

    def __init__(self, *, watch: bool = False) -> None:
        self.last: tuple[tuple[object, ...], dict[str, PackEntry]] = ((), {})
        """The scan's settings (folder, exclusions, rules) and its files' entries."""
        self.watching = watch
        self.watch: FolderWatch | None = None
        self.folders: dict[str, _FolderPlan] = {}
        """Each folder's decisions at the last watched scan and the subfolders walked
        into, by its path from the root; only folders whose decisions last (see
        :func:`_decide_folder`) while the watch saw no change in them."""
        self.linked: set[int] = set()
        """The inodes of the files with more than one link at the last watched scan."""
        self.lock = threading.Lock()
        self.listed = 0
        """Folders the last scan listed (the others it took from the watch's memo)."""


def scan(root: Path, exclude_paths: Iterable[Path] = (), memo: ScanMemo | None = None) -> PackPlan:
    """Decide what of ``root`` to pack; ``exclude_paths`` are never packed
    (GPUMesh's home folder, which holds the private key, when it is inside).

    The consumer's side: ``root`` is the user's own folder, and a symlink in
    it that leads elsewhere inside it is kept (rewritten relative). ``memo``:
    what the last scan of this folder decided, reused where it still holds
    (and updated)."""
    if not root.exists():
        raise ConfigError(f"{root} does not exist: give an existing folder to upload")
    if not root.is_dir():
        raise ConfigError(f"{root} is not a folder: give the folder to upload")
    real_root = os.path.realpath(root)
    excluded = {os.path.realpath(path) for path in exclude_paths}
    for path in excluded:
        if inside(real_root, path):
            raise ConfigError(
                f"refusing to upload {root}: it is inside {path}, GPUMesh's own folder, "
                "which holds your private key; upload your project folder instead"
            )
    if not (platform.has("dir_fd") and platform.has("nofollow")):  # a Tree needs both
        rules = _IgnoreRules.load(Path(real_root))
        return _scan(Path(real_root), _walk_paths(real_root), rules, excluded, None, memo)
    with Tree(real_root) as tree:
        rules = _IgnoreRules.load(tree)
        if memo is not None and memo.watching:
            with memo.lock:
                return _scan_watched(tree, rules, excluded, memo)
        return _scan(tree.path, tree.walk(), rules, excluded, None, memo)


def scan_tree(tree: Tree) -> PackPlan:
    """What :func:`scan` decides, for a folder that something hostile may be
    changing: ``tree`` is walked through descriptors, links are never followed
    (kept only when their text stays inside), and the plan packs files through
    the tree's descriptor (see :attr:`PackPlan.root_fd`)."""
    return _scan(tree.path, tree.walk(), _IgnoreRules.load(tree), set(), tree.fd)


def _walk_paths(root: str) -> Iterator[Folder]:
    """:meth:`Tree.walk` by path, for an OS without descriptor-relative calls
    (Windows): the consumer's own folder, which nothing hostile changes; links
    are still never followed (``lstat``), and ``fd`` is -1."""
    stack = [""]
    while stack:
        relative = stack.pop()
        path = os.path.join(root, *relative.split("/")) if relative else root
        try:
            folder = Folder(relative, -1, list_entries(path, relative))
        except (FileNotFoundError, NotADirectoryError):
            continue  # gone or replaced since its parent was listed
        yield folder
        for name, st in reversed(folder.entries):
            if stat.S_ISDIR(st.st_mode):
                stack.append(f"{relative}/{name}" if relative else name)


def _scan(
    root: Path,
    walk: Iterable[Folder],
    rules: _IgnoreRules,
    excluded: set[str],
    root_fd: int | None,
    memo: ScanMemo | None = None,
) -> PackPlan:
    """The plan for the folders ``walk`` meets under ``root``; ``root_fd``: the
    tree's descriptor when links are never followed (see :func:`scan_tree`),
    None when the folder is the user's own (:func:`scan`)."""
    resolve_links = root_fd is None
    prefix = os.path.join(str(root), "")
    files: list[PackEntry] = []
    skipped: list[Skipped] = []
    key = (prefix, tuple(sorted(excluded)), resolve_links, rules.lines)
    last_key, known = memo.last if memo is not None else ((), {})
    if last_key != key:
        known = {}
    seen: dict[str, PackEntry] = {}
    where = (prefix, excluded, resolve_links)
    try:
        for folder in walk:
            decided, _reusable = _decide_folder(folder, known, seen, rules, where)
            _sort_into(decided, files, skipped)
            folder.entries[:] = _descended(folder.entries, decided)
    except PermissionError as exc:
        raise _unreadable(exc, root) from None
    return _planned(root, files, skipped, root_fd, memo, (key, seen))


def _scan_watched(tree: Tree, rules: _IgnoreRules, excluded: set[str], memo: ScanMemo) -> PackPlan:
    """:func:`_scan` of the user's own folder, listing again only the folders its
    watch saw a change in (all of them when there is no watch, or it says to)."""

    prefix = os.path.join(str(tree.path), "")
    key = (prefix, tuple(sorted(excluded)), True, rules.lines)
    last_key, known = memo.last
    dirty: set[str] | None = None
    if memo.watch is not None:
        dirty = memo.watch.changed()  # drained before anything is listed
        if dirty is None:
            memo.watch.close()
            memo.watch = None
    if memo.watch is None:
        memo.watch = open_watch(tree.fd)
    if last_key != key:
        known, dirty = {}, None
    while True:
        before = memo.folders if dirty is not None else {}
        watched = memo.watch is not None
        now: dict[str, _FolderPlan] = {}
        files: list[PackEntry] = []
        skipped: list[Skipped] = []
        seen: dict[str, PackEntry] = {}
        where = (prefix, excluded, True)
        stack = [""]
        listed = 0
        linked: set[int] = set()
        try:
            while stack:
                relative = stack.pop()
                if relative.count("/") >= MAX_DEPTH:
                    raise LimitError(
                        f"folders nest deeper than {MAX_DEPTH} levels there; "
                        "flatten them and try again"
                    )
                result = (
                    before.get(relative) if dirty is not None and relative not in dirty else None
                )
                if result is None:
                    listing = _list_watched(tree, relative, memo.watch if watched else None)
                    if listing is None:
                        continue  # gone or replaced since its parent was listed
                    folder, watched_here = listing
                    listed += 1
                    linked.update(
                        st.st_ino
                        for _name, st in folder.entries
                        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1
                    )
                    watched = watched and watched_here
                    try:
                        decided, reusable = _decide_folder(folder, known, {}, rules, where)
                    finally:
                        os.close(folder.fd)
                    result = _FolderPlan.of(decided, _descended(folder.entries, decided))
                    if reusable:
                        now[relative] = result
                else:
                    now[relative] = result
                files.extend(result.files)
                skipped.extend(result.skipped)
                seen.update(result.regular)
                stack.extend(f"{relative}/{name}" if relative else name for name in result.descend)
        except PermissionError as exc:
            raise _unreadable(exc, tree.path) from None
        if dirty is None or linked <= memo.linked:
            break
        # A file gained a link since the last scan: written through the other
        # name, its own folder's watch would see nothing, so list them all.
        dirty = None
    memo.linked = linked
    if not watched and memo.watch is not None:  # a folder it could not watch: not trusted
        memo.watch.close()
        memo.watch = None
        memo.watching = False  # nor tried again (too many folders, another device)
    memo.folders = now if watched else {}
    memo.listed = listed
    return _planned(tree.path, files, skipped, None, memo, (key, seen))


class _FolderPlan(NamedTuple):
    """What a scan decided for one folder's entries."""

    files: list[PackEntry]
    skipped: list[Skipped]
    regular: dict[str, PackEntry]
    """The regular files among ``files``, by path."""
    descend: tuple[str, ...]
    """The subfolders walked into."""

    @classmethod
    def of(
        cls, decided: list[PackEntry | Skipped], descend: list[tuple[str, os.stat_result]]
    ) -> _FolderPlan:
        files: list[PackEntry] = []
        skipped: list[Skipped] = []
        _sort_into(decided, files, skipped)
        regular = {entry.path: entry for entry in files if entry.kind == "file"}
        return cls(files, skipped, regular, tuple(name for name, _st in descend))


def _list_watched(
    tree: Tree, relative: str, watch: FolderWatch | None
) -> tuple[Folder, bool] | None:
    """The folder at ``relative``, watched (when ``watch``) and then listed; and
    whether the watch took it. None when it is no longer a folder there."""
    parts = relative.split("/") if relative else []
    try:
        fd = tree.open_dir(parts)
    except PermissionError as exc:
        raise PermissionError(exc.errno, exc.strerror, relative or ".") from None
    except OSError as exc:
        if relative and exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return None
        raise
    try:
        watched = watch is not None and watch.add(fd, relative)
        # Decided while the folder is open: a symlink's text is read through it.
        return Folder(relative, fd, list_entries(fd, relative)), watched
    except BaseException:
        os.close(fd)
        raise


def _decide_folder(
    folder: Folder,
    known: dict[str, PackEntry],
    seen: dict[str, PackEntry],
    rules: _IgnoreRules,
    where: tuple[str, set[str], bool],
) -> tuple[list[PackEntry | Skipped], bool]:
    """What to do with each entry of one listed folder, in its order; and whether
    those decisions hold for as long as the folder itself does not change
    (False when it holds a symlink, whose target may change elsewhere, or a
    file with other links, which may be written through another folder).
    ``known``: the last scan's file entries, reused when a file's size, mtime
    and mode are the same; ``seen`` gets this folder's file entries."""
    decided: list[PackEntry | Skipped] = []
    reusable = True
    for name, st in folder.entries:
        relative = f"{folder.relative}/{name}" if folder.relative else name
        regular = stat.S_ISREG(st.st_mode)
        if (regular and st.st_nlink > 1) or stat.S_ISLNK(st.st_mode):
            reusable = False
        before = known.get(relative)
        if (
            before is not None
            and regular
            and before.size == st.st_size
            and before.mtime_ns == st.st_mtime_ns
            and before.mode == stat.S_IMODE(st.st_mode) & 0o777
        ):
            decided.append(before)
            seen[relative] = before
            continue
        entry = _plan_entry(folder.fd, relative, name, st, rules, where)
        decided.append(entry)
        if isinstance(entry, PackEntry) and entry.kind == "file":
            seen[relative] = entry
    return decided, reusable


def _sort_into(
    decided: Iterable[PackEntry | Skipped], files: list[PackEntry], skipped: list[Skipped]
) -> None:
    for entry in decided:
        if isinstance(entry, Skipped):
            skipped.append(entry)
        else:
            files.append(entry)


def _descended(
    folders: list[tuple[str, os.stat_result]], decided: list[PackEntry | Skipped]
) -> list[tuple[str, os.stat_result]]:
    """The subfolders of ``folders`` that were packed (not skipped): walked into."""
    packed = {
        entry.path.rpartition("/")[2]
        for entry in decided
        if isinstance(entry, PackEntry) and entry.kind == "dir"
    }
    return [(name, st) for name, st in folders if name in packed]


def _unreadable(exc: PermissionError, root: Path) -> ConfigError:
    shown = f"{exc.filename}/" if exc.filename not in (None, ".") else str(root)
    return ConfigError(
        f"cannot read folder {shown}: permission denied; "
        f"fix its permissions or add it to {IGNORE_FILE}"
    )


def _planned(
    root: Path,
    files: list[PackEntry],
    skipped: list[Skipped],
    root_fd: int | None,
    memo: ScanMemo | None,
    last: tuple[tuple[object, ...], dict[str, PackEntry]],
) -> PackPlan:
    # Comparing split paths puts each folder right before its contents, the
    # order tar tools expect, and keeps the archive the same from run to run.
    # (Each "/" taken as a character below all others compares the same, faster.)
    files.sort(key=lambda entry: entry.path.replace("/", "\0"))
    skipped.sort(key=lambda entry: entry.path.rstrip("/").replace("/", "\0"))
    if memo is not None:
        memo.last = last
    return PackPlan(root, tuple(files), tuple(skipped), root_fd)


def _plan_entry(
    folder_fd: int,
    relative: str,
    name: str,
    st: os.stat_result,
    rules: _IgnoreRules,
    where: tuple[str, set[str], bool],
) -> PackEntry | Skipped:
    """One listed entry: packed (and how), or left out (and why)."""
    prefix, excluded, resolve_links = where
    is_dir = stat.S_ISDIR(st.st_mode)
    shown = relative + "/" if is_dir else relative
    # The folder's own name was checked when it was listed.
    if not name.isascii() and not _utf8(name):
        return Skipped(shown, "its name is not valid UTF-8; rename it")
    full = prefix + relative
    if full in excluded:  # no symlink above it: full is already its real path
        return Skipped(shown, "GPUMesh's own folder, never uploaded")
    reason = rules.why_ignored(shown)
    if reason is not None:
        return Skipped(shown, reason)
    mode = stat.S_IMODE(st.st_mode) & 0o777
    mtime = max(0, int(st.st_mtime))
    if is_dir:
        return PackEntry(relative, "dir", 0, mode, mtime)
    if stat.S_ISREG(st.st_mode):
        return PackEntry(relative, "file", st.st_size, mode, mtime, mtime_ns=st.st_mtime_ns)
    if stat.S_ISLNK(st.st_mode):
        try:
            text = os.readlink(name, dir_fd=folder_fd) if folder_fd >= 0 else os.readlink(full)
        except OSError:  # replaced since the listing: nothing to send
            return Skipped(shown, "changed while it was listed")
        if resolve_links:
            target = _link_target(prefix.rstrip(os.sep), relative, full)
        else:  # never followed: kept when its text alone stays inside
            target = text if text_stays_inside(relative.count("/"), text) else None
        if target is None:
            return Skipped(shown, f"symlink to {text}, outside the folder")
        if not _utf8(target):
            return Skipped(shown, "its target is not valid UTF-8")
        return PackEntry(relative, "symlink", 0, 0o777, mtime, target)
    kind = _SPECIAL_KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
    return Skipped(shown, f"{kind}; only files, folders and symlinks go")


# --- writing -------------------------------------------------------------------------------------


_USTAR_LIMIT = 8**11
"""Sizes and times below this fit a ustar header's 12-byte octal fields."""
_TYPES = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE}
_NO_OWNER = b"0000000\x00" * 2
"""uid and gid 0: owners mean nothing on the provider."""
_USTAR_TAIL = b"ustar\x0000" + bytes(32 + 32 + 8 + 8 + 155 + 12)
"""magic, version, empty owner names, device numbers, prefix and the padding to 512."""


def _header(entry: PackEntry) -> bytes:
    """The entry's header: exactly what tarfile's pax format writes for it, built
    directly when it fits a plain ustar header (ASCII names of up to 100 bytes,
    sizes and times under 8 GiB / year 6053), else by tarfile with a pax header.
    tarfile's own path costs ~50 us an entry, most of a small file's time."""
    name = entry.path + "/" if entry.kind == "dir" else entry.path
    if (
        len(name) <= 100
        and len(entry.target) <= 100
        and name.isascii()
        and entry.target.isascii()
        and entry.size < _USTAR_LIMIT
        and 0 <= entry.mtime < _USTAR_LIMIT
    ):
        return _ustar(name, entry)
    return _tarfile_header(entry)


def _ustar(name: str, entry: PackEntry) -> bytes:
    head = b"".join(
        (
            name.encode("ascii").ljust(100, b"\0"),
            b"%07o\0" % (entry.mode & 0o7777),
            _NO_OWNER,
            b"%011o\0" % entry.size,
            b"%011o\0" % entry.mtime,
        )
    )
    rest = _TYPES[entry.kind] + entry.target.encode("ascii").ljust(100, b"\0") + _USTAR_TAIL
    checksum = sum(head) + sum(rest) + 8 * 0x20  # the checksum field counts as spaces
    return head + b"%06o\0 " % checksum + rest


def _tarfile_header(entry: PackEntry) -> bytes:
    info = tarfile.TarInfo(entry.path)
    info.mode = entry.mode
    info.mtime = entry.mtime
    # Owner names and ids stay out: they mean nothing on the provider.
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = _TYPES[entry.kind]
    info.size = entry.size  # 0 but for files
    info.linkname = entry.target  # empty but for symlinks
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "strict")


def _padding(size: int) -> int:
    return -size % _BLOCK


def tar_size(plan: PackPlan) -> int:
    """The exact number of bytes :func:`write_tar` will write for ``plan``."""
    sizes = (len(_header(entry)) + entry.size + _padding(entry.size) for entry in plan.files)
    return len(_END_OF_ARCHIVE) + sum(sizes)


class _Output:
    """Gathers small pieces (headers, small files) into ``_CHUNK``-sized writes."""

    def __init__(self, out: BinaryIO, progress: Callable[[int], None] | None) -> None:
        self._out = out
        self._progress = progress
        self._buffer = bytearray()
        self.written = 0

    def write(self, data: bytes) -> None:
        self._buffer += data
        if len(self._buffer) >= _CHUNK:
            self.flush()

    def flush(self) -> None:
        if not self._buffer:
            return
        data = bytes(self._buffer)
        self._buffer.clear()
        self._out.write(data)
        self.written += len(data)
        if self._progress is not None:
            self._progress(len(data))


def _changed(entry: PackEntry) -> ConfigError:
    return ConfigError(
        f"{entry.path} changed while it was being packed; run again once nothing writes "
        f"to it, or add it to {IGNORE_FILE}"
    )


def _open_entry(plan: PackPlan, entry: PackEntry) -> int:
    # O_NOFOLLOW: a file swapped for a symlink since the scan must not send
    # whatever the link points at; through the tree, no folder on the way is
    # followed either. O_NONBLOCK: a pipe put in its place must not block.
    # Where there is no O_NOFOLLOW (Windows), the path is looked at first and
    # what was opened is checked to be that same file.
    pause_point("pack", entry.path)
    nonblock = platform.open_flag("O_NONBLOCK")
    if plan.root_fd is not None:
        return open_beneath(plan.root_fd, entry.path.split("/"), os.O_RDONLY | nonblock)
    path = os.path.join(plan.root, entry.path)
    nofollow = platform.open_flag("O_NOFOLLOW")
    if nofollow:
        return os.open(path, os.O_RDONLY | nofollow | nonblock)
    seen = os.lstat(path)
    if stat.S_ISLNK(seen.st_mode):
        raise OSError(errno.ELOOP, "a symlink now", str(path))
    fd = os.open(path, os.O_RDONLY | platform.BINARY)
    opened = os.fstat(fd)
    if (opened.st_dev, opened.st_ino) != (seen.st_dev, seen.st_ino):
        os.close(fd)
        raise OSError(errno.ELOOP, "replaced while opened", str(path))
    return fd


class Gathering(Protocol):
    """An output that gathers what it is given into large pieces of its own, and can
    read a file's bytes straight into them (the data channel's sender): the tar
    is then written with no copy of its own in between."""

    def write(self, data: bytes | bytearray | memoryview, /) -> int: ...

    def fill_from(self, fd: int, count: int) -> int:
        """Read bytes ``0..count`` of the file ``fd`` into the output; returns how
        many there were (fewer: the file ended early)."""
        ...


def _open_checked(plan: PackPlan, entry: PackEntry) -> int:
    """The entry's file, open, still a regular file of the scanned size."""
    try:
        fd = _open_entry(plan, entry)
    except PermissionError:
        raise ConfigError(
            f"cannot read {entry.path}: permission denied; fix its permissions "
            f"or add it to {IGNORE_FILE}"
        ) from None
    except OSError:  # gone, or now a symlink (ELOOP)
        raise _changed(entry) from None
    try:
        st = os.fstat(fd)
        # The size went into the header (and into tar_size) already. A regular
        # file ignores O_NONBLOCK, so reads below block as usual.
        if not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
            raise _changed(entry)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_file(plan: PackPlan, entry: PackEntry, output: _Output) -> None:
    fd = _open_checked(plan, entry)
    with os.fdopen(fd, "rb", buffering=0) as source:
        remaining = entry.size
        while remaining:
            chunk = source.read(min(_CHUNK, remaining))
            if not chunk:
                raise _changed(entry)
            output.write(chunk)
            remaining -= len(chunk)
    output.write(b"\0" * _padding(entry.size))


def _gather_file(plan: PackPlan, entry: PackEntry, out: Gathering) -> None:
    fd = _open_checked(plan, entry)
    try:
        if entry.size and out.fill_from(fd, entry.size) != entry.size:
            raise _changed(entry)
    finally:
        os.close(fd)
    out.write(_ZEROS[: _padding(entry.size)])


_ZEROS = bytes(_BLOCK)


def _tar_order(plan: PackPlan) -> Iterator[PackEntry]:
    """The plan's entries in the order the tar carries them: every folder first (each
    still before the folders inside it), then files and symlinks.

    Why: an unpacker makes each folder as its entry comes. Made one by one
    between their files, a 10,000-file tree's folders land in several of
    ext4's block groups, and making its files took 2-3x as long on this
    project's test machine as when every folder was made before the first file
    (all in one group; tmpfs does not care). rsync makes its folders first too.
    The bytes and their count are the same either way; only the order changes.
    """
    yield from (entry for entry in plan.files if entry.kind == "dir")
    yield from (entry for entry in plan.files if entry.kind != "dir")


def write_tar(
    plan: PackPlan, out: BinaryIO | Gathering, progress: Callable[[int], None] | None = None
) -> int:
    """Stream ``plan`` into ``out`` as an uncompressed pax tar; returns the bytes written.

    Memory stays bounded whatever the size: files are read ``_CHUNK`` bytes at a
    time, and small pieces are gathered into writes of about that size.
    ``progress`` is called after each write with the bytes just written. A
    :class:`Gathering` output (no ``progress``) is given every header and file
    as it comes, and reads files' bytes itself.
    """
    if progress is None and hasattr(out, "fill_from"):
        gathering = cast(Gathering, out)
        written = 0
        for entry in _tar_order(plan):
            header = _header(entry)
            gathering.write(header)
            written += len(header)
            if entry.kind == "file":
                _gather_file(plan, entry, gathering)
                written += entry.size + _padding(entry.size)
        gathering.write(_END_OF_ARCHIVE)
        return written + len(_END_OF_ARCHIVE)
    output = _Output(cast(BinaryIO, out), progress)
    for entry in _tar_order(plan):
        output.write(_header(entry))
        if entry.kind == "file":
            _write_file(plan, entry, output)
    output.write(_END_OF_ARCHIVE)
    output.flush()
    return output.written
