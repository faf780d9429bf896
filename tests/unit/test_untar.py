"""files/untar and pack's headers: the fast unpacker reads what tar tools write, keeps
modes and times, survives trees wider than its open folders, and refuses what
tarfile would have let through by accident (an archive cut between entries).

The hostile-archive refusals themselves are in test_pack.py (same function).
"""

from __future__ import annotations

import io
import itertools
import os
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumesh.errors import ProtocolError
from gpumesh.files.pack import PackEntry, _header, _tarfile_header, scan, write_tar
from gpumesh.files.untar import unpack_stream, unpack_tar

BIG = 1 << 40


def tar_of(root: Path) -> bytes:
    out = io.BytesIO()
    write_tar(scan(root), out)
    return out.getvalue()


@pytest.mark.parametrize(
    ("path", "kind", "size", "mtime", "target"),
    [
        ("a", "file", 0, 0, ""),
        ("d/e/f.bin", "file", 8**11 - 1, 1_700_000_000, ""),
        ("x" * 100, "file", 1, 1, ""),
        ("x" * 99, "dir", 0, 5, ""),  # 100 with its slash
        ("x" * 100, "dir", 0, 5, ""),  # 101: a pax header
        ("big", "file", 8**11, 5, ""),  # a pax size
        ("late", "file", 1, 8**11, ""),  # a pax time
        ("caf\u00e9", "file", 3, 5, ""),  # not ASCII: a pax path
        ("l", "symlink", 0, 5, "t" * 100),
        ("l", "symlink", 0, 5, "t" * 101),
    ],
)
def test_headers_are_byte_for_byte_what_tarfile_writes(
    path: str, kind: str, size: int, mtime: int, target: str
) -> None:
    for mode in (0o644, 0o755, 0o700):
        entry = PackEntry(path, kind, size, mode, mtime, target)  # type: ignore[arg-type]
        assert _header(entry) == _tarfile_header(entry)


def test_modes_and_times_arrive(tmp_path: Path) -> None:
    root = tmp_path / "r"
    (root / "private").mkdir(parents=True)
    (root / "private" / "key").write_text("k")
    (root / "tool").write_text("#!/bin/sh\n")
    os.chmod(root / "tool", 0o755)
    os.chmod(root / "private" / "key", 0o600)
    os.chmod(root / "private", 0o700)
    os.utime(root / "tool", (1_600_000_000, 1_600_000_000))
    os.utime(root / "private", (1_500_000_000, 1_500_000_000))
    unpack_tar(io.BytesIO(tar_of(root)), tmp_path / "dest", BIG)
    dest = tmp_path / "dest"
    assert stat.S_IMODE((dest / "tool").stat().st_mode) == 0o755
    assert stat.S_IMODE((dest / "private" / "key").stat().st_mode) == 0o600
    assert stat.S_IMODE((dest / "private").stat().st_mode) == 0o700
    assert int((dest / "tool").stat().st_mtime) == 1_600_000_000
    assert int((dest / "private").stat().st_mtime) == 1_500_000_000


def _modes_tree(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    for name, mode in (("tool", 0o755), ("data", 0o644), ("sub/key", 0o600), ("sub/run", 0o700)):
        (root / name).write_text(name)
        os.chmod(root / name, mode)
    return root


def _modes(dest: Path) -> dict[str, int]:
    return {
        name: stat.S_IMODE((dest / name).stat().st_mode)
        for name in ("tool", "data", "sub/key", "sub/run")
    }


_EXACT = {"tool": 0o755, "data": 0o644, "sub/key": 0o600, "sub/run": 0o700}


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077, 0o000])
def test_modes_arrive_exactly_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    # Files are made with their final mode, and set again only where the umask
    # took bits away: either way they end up exactly as sent.
    data = tar_of(_modes_tree(tmp_path / "r"))
    before = os.umask(umask)
    try:
        unpack_tar(io.BytesIO(data), tmp_path / "dest", BIG)
    finally:
        os.umask(before)
    assert _modes(tmp_path / "dest") == _EXACT


def test_modes_arrive_exactly_under_a_default_acl(tmp_path: Path) -> None:
    # A default ACL (here: nothing for group and others) decides a new file's
    # mode instead of the umask; the unpacker sees it and sets each mode.
    parent = tmp_path / "acl"
    parent.mkdir()
    entries = [(0x01, 0o7), (0x04, 0), (0x20, 0)]  # user::rwx, group::---, other::---
    acl = (2).to_bytes(4, "little") + b"".join(
        tag.to_bytes(2, "little") + perm.to_bytes(2, "little") + (2**32 - 1).to_bytes(4, "little")
        for tag, perm in entries
    )
    try:
        os.setxattr(parent, "system.posix_acl_default", acl)
    except OSError as exc:
        pytest.skip(f"this filesystem keeps no ACLs: {exc.strerror}")
    probe = parent / "probe"
    probe.touch(mode=0o755)
    assert stat.S_IMODE(probe.stat().st_mode) == 0o700  # the ACL took group and other
    probe.unlink()
    unpack_tar(io.BytesIO(tar_of(_modes_tree(tmp_path / "r"))), parent / "dest", BIG)
    assert _modes(parent / "dest") == _EXACT


def test_a_tree_wider_and_deeper_than_the_open_folders(tmp_path: Path) -> None:
    root = tmp_path / "r"
    for a, b in itertools.product(range(12), range(12)):  # 156 folders, files in each
        folder = root / f"a{a}" / f"b{b}"
        folder.mkdir(parents=True)
        (folder / "f").write_bytes(bytes([a, b]) * 700)
    deep = root.joinpath(*(f"n{i}" for i in range(80)))
    deep.mkdir(parents=True)
    (deep / "end").write_text("deep")
    unpack_tar(io.BytesIO(tar_of(root)), tmp_path / "dest", BIG)
    for a, b in itertools.product(range(12), range(12)):
        assert (tmp_path / "dest" / f"a{a}" / f"b{b}" / "f").read_bytes() == bytes([a, b]) * 700
    assert (tmp_path / "dest").joinpath(*(f"n{i}" for i in range(80)), "end").read_text() == "deep"


def test_pieces_cut_anywhere_give_the_same_tree(tmp_path: Path) -> None:
    root = tmp_path / "r"
    (root / "s").mkdir(parents=True)
    for i in range(30):
        (root / "s" / f"f{i}").write_bytes(os.urandom(i * 97))
    data = tar_of(root)
    for step in (1, 7, 511, 513, 4096):
        dest = tmp_path / f"dest{step}"
        pieces = iter([memoryview(data)[i : i + step] for i in range(0, len(data), step)])

        def next_piece(pieces: Iterator[memoryview] = pieces) -> memoryview | None:
            return next(pieces, None)

        unpack_stream(next_piece, dest, BIG)
        for i in range(30):
            assert (dest / "s" / f"f{i}").read_bytes() == (root / "s" / f"f{i}").read_bytes()


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs the tar tool")
@pytest.mark.parametrize("form", ["gnu", "posix", "ustar", "v7"])
def test_what_the_tar_tool_writes(tmp_path: Path, form: str) -> None:
    root = tmp_path / "r"
    long = "n" * 120 if form in ("gnu", "posix") else "short"
    (root / "d" / long).mkdir(parents=True)
    (root / "d" / long / "f.txt").write_text("content")
    os.symlink("d", root / "link")
    archive = tmp_path / "t.tar"
    subprocess.run(
        ["tar", f"--format={form}", "-cf", str(archive), "-C", str(root), "."], check=True
    )
    unpack_tar(archive, tmp_path / "dest", BIG)
    assert (tmp_path / "dest" / "d" / long / "f.txt").read_text() == "content"
    assert os.readlink(tmp_path / "dest" / "link") == "d"


def test_an_archive_cut_between_entries_is_refused(tmp_path: Path) -> None:
    # tarfile took a clean cut after a whole entry for the end; the upload was incomplete.
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "a").write_bytes(b"x" * 1000)
    (tmp_path / "r" / "b").write_bytes(b"y" * 1000)
    data = tar_of(tmp_path / "r")
    with pytest.raises(ProtocolError) as caught:
        unpack_tar(io.BytesIO(data[: 512 + 1024]), tmp_path / "dest", BIG)
    assert str(caught.value) == (
        "refused the upload: not a complete tar archive (no end-of-archive marker)"
    )
    assert not (tmp_path / "dest").exists()


def test_a_gnu_sparse_file_is_refused(tmp_path: Path) -> None:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as archive:
        info = tarfile.TarInfo("holes")
        info.size = 1
        info.pax_headers = {"GNU.sparse.size": "100"}
        archive.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(ProtocolError) as caught:
        unpack_tar(io.BytesIO(out.getvalue()), tmp_path / "dest", BIG)
    assert str(caught.value) == (
        "refused the upload: entry 'holes' is a sparse file; gpumesh never sends those"
    )


def test_without_descriptor_calls_the_same_tree_arrives_by_path(tmp_path: Path) -> None:
    # Windows has no dir_fd: a download unpacks by path in its fresh private folder.
    from gpumesh import platform

    root = tmp_path / "r"
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "sub" / "deeper" / "f").write_bytes(b"x" * 3000)
    (root / "tool").write_text("#!/bin/sh\n")
    os.chmod(root / "tool", 0o755)
    os.chmod(root / "sub", 0o700)
    os.symlink("sub/deeper/f", root / "link")
    data = tar_of(root)
    try:
        platform.configure({"GPUMESH_TEST_WITHOUT": "dir_fd"})
        unpack_tar(io.BytesIO(data), tmp_path / "by-path", BIG)
        assert "dir_fd" in platform.taken()
    finally:
        platform.configure({})
    unpack_tar(io.BytesIO(data), tmp_path / "by-fd", BIG)
    for dest in (tmp_path / "by-path", tmp_path / "by-fd"):
        assert (dest / "sub" / "deeper" / "f").read_bytes() == b"x" * 3000
        assert stat.S_IMODE((dest / "tool").stat().st_mode) == 0o755
        assert stat.S_IMODE((dest / "sub").stat().st_mode) == 0o700
        assert os.readlink(dest / "link") == "sub/deeper/f"


class _Collected:
    """A :class:`Gathering` output into memory (what the data channel's writer does
    into its pieces), as ``io.BytesIO`` is for the other path."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes | bytearray | memoryview, /) -> int:
        self.data += data
        return len(data)

    def fill_from(self, fd: int, count: int) -> int:
        got = os.pread(fd, count, 0)
        self.data += got
        return len(got)


def test_a_gathering_output_gets_the_same_bytes(tmp_path: Path) -> None:
    root = tmp_path / "r"
    (root / "s").mkdir(parents=True)
    for i in range(20):
        (root / "s" / f"f{i}").write_bytes(os.urandom(i * 301))
    os.symlink("s/f3", root / "link")
    plan = scan(root)
    gathered = _Collected()
    written = write_tar(plan, gathered)
    assert bytes(gathered.data) == tar_of(root)
    assert written == len(gathered.data)


@pytest.mark.parametrize("change", ["shrink", "grow"])
def test_a_file_changed_after_the_scan_stops_a_gathered_tar(tmp_path: Path, change: str) -> None:
    from gpumesh.errors import ConfigError

    root = tmp_path / "r"
    root.mkdir()
    (root / "data").write_bytes(b"x" * 5000)
    plan = scan(root)
    (root / "data").write_bytes(b"x" * (10 if change == "shrink" else 9000))
    with pytest.raises(ConfigError) as caught:
        write_tar(plan, _Collected())
    assert str(caught.value).startswith("data changed while it was being packed; run again")


def test_everything_made_is_given_the_owner_named(tmp_path: Path) -> None:
    # A provider that runs jobs as another user names it: the unpacker gives it
    # each folder, file and link as it makes them (there is no second walk).
    from gpumesh import platform

    if os.geteuid() != 0:
        pytest.skip("giving files away needs root (CI runs as root)")
    root = tmp_path / "r"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f").write_text("f")
    (root / "g").write_text("g")
    os.symlink("../g", root / "a" / "up")
    os.link(root / "g", root / "h")
    data = tar_of(root)
    owner = (47001, 47002)
    try:
        platform.configure({"GPUMESH_TEST_WITHOUT": "dir_fd"})
        unpack_tar(io.BytesIO(data), tmp_path / "by-path", BIG, owner=owner)
    finally:
        platform.configure({})
    unpack_tar(io.BytesIO(data), tmp_path / "by-fd", BIG, owner=owner)
    unpack_tar(io.BytesIO(data), tmp_path / "nobody-named", BIG)
    for dest in (tmp_path / "by-path", tmp_path / "by-fd"):
        found = {
            str(path.relative_to(dest)): (path.lstat().st_uid, path.lstat().st_gid)
            for path in [dest, *dest.rglob("*")]
        }
        assert set(found) == {".", "a", "a/b", "a/b/f", "a/up", "g", "h"}
        assert set(found.values()) == {owner}, found
        assert (dest / "a" / "b" / "f").read_text() == "f"
        assert stat.S_IMODE((dest / "a" / "b" / "f").stat().st_mode) & 0o600 == 0o600
    assert (tmp_path / "nobody-named" / "g").stat().st_uid == os.geteuid()
