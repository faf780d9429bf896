"""client/pack: what is packed and why not, the exact tar size, and a hostile-archive-proof unpack.

Every tree here is real files under a temporary folder. Unpack refusals are
checked for their message, for leaving no destination and no temporary folder
behind, and for writing nothing outside.
"""

from __future__ import annotations

import gzip
import io
import os
import shutil
import socket
import stat
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumesh.errors import AgentError, ConfigError, LimitError, ProtocolError
from gpumesh.files import pack
from gpumesh.files.pack import (
    DEFAULT_IGNORES,
    PackPlan,
    Skipped,
    scan,
    tar_size,
    unpack_tar,
    write_tar,
)
from gpumesh.units import format_size

BIG = 1 << 40


def make(root: Path, files: dict[str, str | bytes]) -> Path:
    """Create ``files`` under root; a name ending in / is a folder."""
    for name, content in files.items():
        path = root / name
        if name.endswith("/"):
            path.mkdir(parents=True, exist_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    return root


def packed(plan: PackPlan) -> list[str]:
    return [entry.path for entry in plan.files]


def skipped(plan: PackPlan) -> dict[str, str]:
    return {entry.path: entry.reason for entry in plan.skipped}


def tar_bytes(plan: PackPlan) -> bytes:
    out = io.BytesIO()
    write_tar(plan, out)
    return out.getvalue()


def snapshot(root: Path) -> dict[str, tuple[str, int, bytes | str | None]]:
    """Every entry under root: kind, permission bits, content or link target."""
    found: dict[str, tuple[str, int, bytes | str | None]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            relative = path.relative_to(root).as_posix()
            st_ = path.lstat()
            if stat.S_ISLNK(st_.st_mode):
                found[relative] = ("symlink", 0, os.readlink(path))
            elif stat.S_ISDIR(st_.st_mode):
                found[relative] = ("dir", 0, None)
            else:
                found[relative] = ("file", stat.S_IMODE(st_.st_mode), path.read_bytes())
    return found


# --- what is packed ----------------------------------------------------------------------------


def test_defaults_are_left_out_anywhere(tmp_path: Path) -> None:
    make(
        tmp_path,
        {
            "train.py": "print()",
            ".git/config": "",
            ".venv/bin/python": "",
            "venv/lib/x": "",
            "__pycache__/train.cpython-311.pyc": "",
            "node_modules/left-pad/index.js": "",
            ".gpumesh/key": "",
            "model.pyc": "",
            "sub/.git/HEAD": "",
            "sub/pkg/__pycache__/m.pyc": "",
            "sub/pkg/m.py": "",
            "sub/lib.pyc": "",
        },
    )
    plan = scan(tmp_path)
    assert packed(plan) == ["sub", "sub/pkg", "sub/pkg/m.py", "train.py"]
    assert skipped(plan) == {
        ".git/": "default rule '.git/'",
        ".gpumesh/": "default rule '.gpumesh/'",
        ".venv/": "default rule '.venv/'",
        "__pycache__/": "default rule '__pycache__/'",
        "model.pyc": "default rule '*.pyc'",
        "node_modules/": "default rule 'node_modules/'",
        "sub/.git/": "default rule '.git/'",
        "sub/lib.pyc": "default rule '*.pyc'",
        "sub/pkg/__pycache__/": "default rule '__pycache__/'",
        "venv/": "default rule 'venv/'",
    }
    assert plan.total_bytes == len("print()")


def test_a_file_named_like_a_default_folder_is_packed(tmp_path: Path) -> None:
    make(tmp_path, {"venv": "a file, not a folder", ".git": "gitdir: ../x"})
    assert packed(scan(tmp_path)) == [".git", "venv"]


def test_user_rules_with_lines_and_unignoring_defaults(tmp_path: Path) -> None:
    make(
        tmp_path,
        {
            ".gpumeshignore": "# data stays home\n\ndata/\n*.ckpt\n!.venv/\n!keep.pyc\n/top.txt\n",
            "data/big.bin": "x",
            "a.ckpt": "x",
            "sub/b.ckpt": "x",
            ".venv/bin/python": "x",
            "keep.pyc": "x",
            "other.pyc": "x",
            "top.txt": "x",
            "sub/top.txt": "x",
        },
    )
    plan = scan(tmp_path)
    assert packed(plan) == [
        ".gpumeshignore",
        ".venv",
        ".venv/bin",
        ".venv/bin/python",
        "keep.pyc",
        "sub",
        "sub/top.txt",
    ]
    assert skipped(plan) == {
        "a.ckpt": ".gpumeshignore:4 '*.ckpt'",
        "data/": ".gpumeshignore:3 'data/'",
        "other.pyc": "default rule '*.pyc'",
        "sub/b.ckpt": ".gpumeshignore:4 '*.ckpt'",
        "top.txt": ".gpumeshignore:7 '/top.txt'",
    }


def test_nothing_inside_a_left_out_folder_comes_back(tmp_path: Path) -> None:
    # As in git: a file cannot be re-included when a folder above it is excluded.
    make(tmp_path, {".gpumeshignore": "build/\n!build/keep.txt\n", "build/keep.txt": "x"})
    plan = scan(tmp_path)
    assert packed(plan) == [".gpumeshignore"]
    assert skipped(plan) == {"build/": ".gpumeshignore:1 'build/'"}


def test_last_matching_rule_wins(tmp_path: Path) -> None:
    make(tmp_path, {".gpumeshignore": "*.log\n!keep.log\n*.log\n", "keep.log": "x"})
    assert skipped(scan(tmp_path)) == {"keep.log": ".gpumeshignore:3 '*.log'"}


@pytest.mark.parametrize(
    ("lines", "number", "bad"),
    [("ok/\n!\n", 2, "!"), ("\\\n", 1, "\\"), ("a\n\n# c\nfoo[bar\n", 4, "foo[bar")],
)
def test_invalid_pattern_names_the_line(tmp_path: Path, lines: str, number: int, bad: str) -> None:
    make(tmp_path, {".gpumeshignore": lines})
    with pytest.raises(ConfigError) as caught:
        scan(tmp_path)
    assert str(caught.value) == (
        f".gpumeshignore:{number}: invalid pattern {bad!r}; fix or remove it "
        "(the syntax is .gitignore's)"
    )


def test_ignore_file_must_be_utf8(tmp_path: Path) -> None:
    make(tmp_path, {".gpumeshignore": b"caf\xe9/\n"})
    with pytest.raises(ConfigError, match=r"^\.gpumeshignore is not UTF-8 text; save it as UTF-8$"):
        scan(tmp_path)


def test_home_folder_inside_the_tree_is_never_packed(tmp_path: Path) -> None:
    make(tmp_path, {"train.py": "", "state/identity.key": "secret", "state/x/y": ""})
    plan = scan(tmp_path, exclude_paths=[tmp_path / "state"])
    assert packed(plan) == ["train.py"]
    assert skipped(plan) == {"state/": "GPUMesh's own folder, never uploaded"}


def test_home_folder_reached_through_a_symlinked_path(tmp_path: Path) -> None:
    make(tmp_path, {"real/proj/home/key": "secret", "real/proj/a": ""})
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    plan = scan(tmp_path / "real" / "proj", exclude_paths=[tmp_path / "alias" / "proj" / "home"])
    assert packed(plan) == ["a"]


@pytest.mark.parametrize("inner", [".", "sub"])
def test_packing_the_home_folder_itself_is_refused(tmp_path: Path, inner: str) -> None:
    make(tmp_path, {"home/sub/x": "", "home/key": "secret"})
    root = tmp_path / "home" / inner
    with pytest.raises(ConfigError) as caught:
        scan(root, exclude_paths=[tmp_path / "home"])
    assert str(caught.value) == (
        f"refusing to upload {root}: it is inside {tmp_path / 'home'}, GPUMesh's own folder, "
        "which holds your private key; upload your project folder instead"
    )


def test_symlinks(tmp_path: Path) -> None:
    outside = make(tmp_path / "outside", {"secret": "s", "dir/x": "x"})
    root = make(tmp_path / "proj", {"a.py": "a", "data/set/x.csv": "1,2", "sub/": ""})
    (root / "rel").symlink_to("a.py")
    (root / "sub" / "up").symlink_to("../a.py")
    (root / "abs_inside").symlink_to(root / "data" / "set")
    (root / "sub" / "detour").symlink_to("../../proj/a.py")
    (root / "dangling").symlink_to("not-yet")
    (root / "data_link").symlink_to("data")
    (root / "out_abs").symlink_to(outside / "secret")
    (root / "out_rel").symlink_to("../outside/dir")
    (root / "sub" / "chain").symlink_to("../out_abs")
    (root / "itself").symlink_to(".")
    plan = scan(root)
    links = {e.path: e.target for e in plan.files if e.kind == "symlink"}
    assert links == {
        "rel": "a.py",
        "sub/up": "../a.py",
        "abs_inside": "data/set",
        "sub/detour": "../a.py",
        "dangling": "not-yet",
        "data_link": "data",
        "itself": ".",
    }
    assert skipped(plan) == {
        "out_abs": f"symlink to {outside / 'secret'}, outside the folder",
        "out_rel": "symlink to ../outside/dir, outside the folder",
        "sub/chain": "symlink to ../out_abs, outside the folder",
    }
    # A linked folder is sent as a link, not a second copy of its contents.
    assert not any(path.startswith("data_link/") for path in packed(plan))
    # And they all still work after the trip.
    dest = tmp_path / "dest"
    unpack_tar(io.BytesIO(tar_bytes(plan)), dest, BIG)
    assert (dest / "abs_inside" / "x.csv").read_text() == "1,2"
    assert (dest / "sub" / "detour").read_text() == "a"
    assert (dest / "rel").read_text() == "a"


def test_symlinks_follow_the_ignore_rules_as_files(tmp_path: Path) -> None:
    root = make(tmp_path, {".gpumeshignore": "link\n", "target/x": ""})
    (root / "link").symlink_to("target")
    assert skipped(scan(root)) == {"link": ".gpumeshignore:1 'link'"}


def test_special_files_are_skipped(tmp_path: Path) -> None:
    root = make(tmp_path / "r", {"a": "x"})
    os.mkfifo(root / "pipe")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(root / "sock"))
        plan = scan(root)
    assert packed(plan) == ["a"]
    assert skipped(plan) == {
        "pipe": "a named pipe; only files, folders and symlinks go",
        "sock": "a socket; only files, folders and symlinks go",
    }


def test_names_that_are_not_utf8_are_skipped(tmp_path: Path) -> None:
    try:
        fd = os.open(os.path.join(os.fsencode(tmp_path), b"caf\xe9.txt"), os.O_CREAT | os.O_WRONLY)
    except OSError:
        pytest.skip("this file system refuses names that are not UTF-8")
    os.close(fd)
    make(tmp_path, {"ok.txt": ""})
    plan = scan(tmp_path)
    assert packed(plan) == ["ok.txt"]
    assert list(skipped(plan).values()) == ["its name is not valid UTF-8; rename it"]


def test_root_must_be_a_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"does not exist: give an existing folder to upload$"):
        scan(tmp_path / "nope")
    make(tmp_path, {"f": ""})
    with pytest.raises(ConfigError, match=r"f is not a folder: give the folder to upload$"):
        scan(tmp_path / "f")


def _deny(monkeypatch: pytest.MonkeyPatch, name: str, denied: str) -> None:
    """Make os.<name> refuse ``denied`` as a non-root user would (the tests may run as root)."""
    real = getattr(os, name)

    def guarded(path: object, *args: object, **kwargs: object) -> object:
        if str(path).endswith(denied):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, name, guarded)


def test_unreadable_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make(tmp_path, {"locked/x": "", "ok": ""})
    _deny(monkeypatch, "open", "locked")  # the walk opens each folder by its own name
    with pytest.raises(ConfigError) as caught:
        scan(tmp_path)
    assert str(caught.value) == (
        "cannot read folder locked/: permission denied; fix its permissions "
        "or add it to .gpumeshignore"
    )


def test_unreadable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make(tmp_path, {"secret.bin": "x"})
    plan = scan(tmp_path)
    _deny(monkeypatch, "open", "secret.bin")
    with pytest.raises(ConfigError) as caught:
        write_tar(plan, io.BytesIO())
    assert str(caught.value) == (
        "cannot read secret.bin: permission denied; fix its permissions or add it to .gpumeshignore"
    )


def test_order_puts_each_folder_before_its_contents(tmp_path: Path) -> None:
    make(tmp_path, {"a/b/c": "", "a.txt": "", "a/z": "", "a-b": "", "b/": ""})
    assert packed(scan(tmp_path)) == ["a", "a/b", "a/b/c", "a/z", "a-b", "a.txt", "b"]


# --- writing the tar -----------------------------------------------------------------------------


def test_tar_is_readable_and_exact(tmp_path: Path) -> None:
    root = make(
        tmp_path / "r",
        {"run.sh": "#!/bin/sh\necho hi\n", "empty/": "", "d/" + "n" * 150: "long name"},
    )
    (root / "run.sh").chmod(0o755)
    plan = scan(root)
    data = tar_bytes(plan)
    assert len(data) == tar_size(plan)
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        members = {m.name: m for m in archive.getmembers()}
        assert set(members) == {"d", "d/" + "n" * 150, "empty", "run.sh"}
        run = members["run.sh"]
        assert (run.mode, run.uid, run.uname) == (0o755, 0, "")
        extracted = archive.extractfile(run)
        assert extracted is not None and extracted.read() == b"#!/bin/sh\necho hi\n"


@pytest.mark.skipif(shutil.which("tar") is None, reason="no tar command")
def test_tar_command_reads_it(tmp_path: Path) -> None:
    root = make(tmp_path / "r", {"é/日本.txt": "x", "a" * 120: "y"})
    archive = tmp_path / "out.tar"
    with archive.open("wb") as out:
        write_tar(scan(root), out)
    listed = subprocess.run(
        ["tar", "-tf", str(archive)], capture_output=True, text=True, check=True
    )
    assert sorted(listed.stdout.split()) == ["a" * 120, "é/", "é/日本.txt"]
    assert listed.stderr == ""


def test_the_tar_carries_every_folder_before_any_file(tmp_path: Path) -> None:
    # An unpacker then makes every folder before the first file (ext4 makes a
    # tree's files much faster that way); each folder still comes before the
    # folders inside it, and the bytes are the same count.
    make(tmp_path, {"a/b/c": "1", "a.txt": "2", "a/z": "3", "b/d/e": "4", "c/": ""})
    plan = scan(tmp_path)
    data = tar_bytes(plan)
    assert len(data) == tar_size(plan)
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        names = [(m.name, m.isdir()) for m in archive.getmembers()]
    assert names == [
        ("a", True),
        ("a/b", True),
        ("b", True),
        ("b/d", True),
        ("c", True),
        ("a/b/c", False),
        ("a/z", False),
        ("a.txt", False),
        ("b/d/e", False),
    ]


def test_same_tree_same_bytes(tmp_path: Path) -> None:
    make(tmp_path, {"a": "1", "b/c": "2"})
    assert tar_bytes(scan(tmp_path)) == tar_bytes(scan(tmp_path))


def test_progress_and_bounded_writes(tmp_path: Path) -> None:
    size = 5 * pack._CHUNK + 123
    make(tmp_path, {"big.bin": os.urandom(size), **{f"small/{i}": "x" * i for i in range(200)}})
    plan = scan(tmp_path)
    writes: list[int] = []
    reported: list[int] = []

    class Recorder(io.RawIOBase):
        def write(self, data: object) -> int:
            assert isinstance(data, bytes)
            writes.append(len(data))
            return len(data)

    total = write_tar(plan, Recorder(), reported.append)  # type: ignore[arg-type]
    assert total == sum(writes) == sum(reported) == tar_size(plan)
    assert reported == writes
    # Constant memory: nothing near the file's size is ever held, and the
    # many small pieces are gathered rather than written one by one.
    assert max(writes) < 2 * pack._CHUNK
    assert len(writes) < 10


def test_a_file_that_changes_after_the_scan(tmp_path: Path) -> None:
    make(tmp_path, {"log.txt": "short"})
    plan = scan(tmp_path)
    (tmp_path / "log.txt").write_text("much longer now")
    with pytest.raises(ConfigError) as caught:
        write_tar(plan, io.BytesIO())
    assert str(caught.value) == (
        "log.txt changed while it was being packed; run again once nothing writes to it, "
        "or add it to .gpumeshignore"
    )


def test_a_file_swapped_for_a_symlink_after_the_scan(tmp_path: Path) -> None:
    make(tmp_path, {"proj/data": "12345", "secret": "s3cr3t"})
    plan = scan(tmp_path / "proj")
    (tmp_path / "proj" / "data").unlink()
    (tmp_path / "proj" / "data").symlink_to(tmp_path / "secret")
    out = io.BytesIO()
    with pytest.raises(ConfigError, match=r"^data changed while it was being packed"):
        write_tar(plan, out)
    assert b"s3cr3t" not in out.getvalue()


def test_a_file_removed_after_the_scan(tmp_path: Path) -> None:
    make(tmp_path, {"gone": "x"})
    plan = scan(tmp_path)
    (tmp_path / "gone").unlink()
    with pytest.raises(ConfigError, match=r"^gone changed while it was being packed"):
        write_tar(plan, io.BytesIO())


# --- round trips with exact sizes (hypothesis) ---------------------------------------------------

_NAME = st.text(st.sampled_from("abcXYZ019_- éü日本"), min_size=1, max_size=60).filter(
    lambda n: n not in ("venv", "node_modules", "__pycache__")
)
_SIZES = st.sampled_from([0, 1, 511, 512, 513, 1024, 1500, 10_000])
_CONTENT = st.one_of(
    st.binary(max_size=600), _SIZES.map(lambda n: bytes(range(256)) * (n // 256) + b"z" * (n % 256))
)
_MODES = st.sampled_from([0o644, 0o755, 0o600, 0o700, 0o444, 0o664, 0o4755, 0o750])
# Targets stay inside however deep the link is: each is a name below the link's
# own folder (dangling is fine), and long ones need a pax linkpath header.
_LINK = st.lists(_NAME, min_size=1, max_size=4).map(lambda names: ("link", "/".join(names)))
_TREE = st.recursive(
    st.one_of(st.tuples(_CONTENT, _MODES), _LINK),
    lambda children: st.dictionaries(_NAME, children, max_size=4),
    max_leaves=12,
)


def _build(path: Path, node: object) -> None:
    if isinstance(node, dict):
        path.mkdir()
        for name, child in node.items():
            _build(path / name, child)
    elif isinstance(node, tuple) and node[0] == "link":
        path.symlink_to(node[1])
    else:
        assert isinstance(node, tuple)
        content, mode = node
        path.write_bytes(content)
        path.chmod(mode)


def _expected_mode(mode: int) -> int:
    # What tarfile's "data" filter keeps: no set-id, no group/other write,
    # owner read-write always, exec bits only when the owner's is set.
    mode &= 0o755
    if not mode & 0o100:
        mode &= ~0o111
    return mode | 0o600


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_NAME, _TREE, max_size=5), st.booleans())
def test_round_trip_is_byte_identical_and_tar_size_exact(
    tree: dict[str, object], deep: bool
) -> None:
    with tempfile.TemporaryDirectory() as temp:
        base = Path(temp)
        root = base / "src"
        if deep:
            # Every path then needs a pax header (over 100 bytes), which tar_size must count.
            tree = {"long" * 30: tree}
        _build(root, tree)
        plan = scan(root)
        out = io.BytesIO()
        progress: list[int] = []
        written = write_tar(plan, out, progress.append)
        assert written == len(out.getvalue()) == tar_size(plan) == sum(progress)
        assert len(out.getvalue()) % 512 == 0
        out.seek(0)
        dest = base / "dest"
        assert unpack_tar(out, dest, BIG) == plan.total_bytes
        before, after = snapshot(root), snapshot(dest)
        assert before.keys() == after.keys()
        for path, (kind, mode, content) in before.items():
            assert after[path] == (kind, _expected_mode(mode) if kind == "file" else 0, content)
            if kind == "file":
                assert int((dest / path).stat().st_mtime) == int((root / path).stat().st_mtime)


def test_exec_bit_survives(tmp_path: Path) -> None:
    root = make(tmp_path / "r", {"run.sh": "#!/bin/sh\n", "data.txt": ""})
    (root / "run.sh").chmod(0o755)
    (root / "data.txt").chmod(0o644)
    dest = tmp_path / "dest"
    unpack_tar(io.BytesIO(tar_bytes(scan(root))), dest, BIG)
    assert stat.S_IMODE((dest / "run.sh").stat().st_mode) == 0o755
    assert stat.S_IMODE((dest / "data.txt").stat().st_mode) == 0o644
    assert os.access(dest / "run.sh", os.X_OK)


# --- unpacking: the destination and its limit ----------------------------------------------------


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


def test_unpack_from_a_path_into_an_existing_empty_folder(tmp_path: Path) -> None:
    root = make(tmp_path / "r", {"a/b": "c"})
    archive = tmp_path / "up.tar"
    archive.write_bytes(tar_bytes(scan(root)))
    dest = tmp_path / "jobs" / "work"
    dest.mkdir(parents=True)
    assert unpack_tar(archive, dest, BIG) == 1
    assert (dest / "a" / "b").read_text() == "c"
    assert _leftovers(tmp_path / "jobs") == ["work"]


@pytest.mark.parametrize("kind", ["file", "full folder", "symlink"])
def test_unpack_refuses_a_used_destination(tmp_path: Path, kind: str) -> None:
    dest = tmp_path / "dest"
    if kind == "file":
        dest.write_text("x")
    elif kind == "full folder":
        make(dest, {"keep": "x"})
    else:
        dest.symlink_to(tmp_path)
    with pytest.raises(FileExistsError):
        unpack_tar(io.BytesIO(b""), dest, BIG)
    assert dest.is_symlink() or dest.exists()


class _StreamOnly:
    """A source with nothing but read(), as a network stream is, counting bytes."""

    def __init__(self, data: bytes) -> None:
        self._data = io.BytesIO(data)
        self.read_bytes = 0

    def read(self, size: int = -1) -> bytes:
        chunk = self._data.read(size)
        self.read_bytes += len(chunk)
        return chunk


def _as_stream(data: bytes) -> BinaryIO:
    return _StreamOnly(data)  # type: ignore[return-value]


def test_unpack_reads_a_plain_stream(tmp_path: Path) -> None:
    root = make(tmp_path / "r", {"x": "y" * 5000})
    unpack_tar(_as_stream(tar_bytes(scan(root))), tmp_path / "dest", BIG)
    assert (tmp_path / "dest" / "x").read_text() == "y" * 5000


def test_limit_is_the_exact_tar_size(tmp_path: Path) -> None:
    root = make(tmp_path / "r", {f"f{i}": "x" * (i * 100) for i in range(30)})
    plan = scan(root)
    data = tar_bytes(plan)
    jail = tmp_path / "jail"
    jail.mkdir()
    with pytest.raises(LimitError) as caught:
        unpack_tar(io.BytesIO(data), jail / "dest", tar_size(plan) - 1)
    assert str(caught.value).startswith(
        f"the upload is larger than this provider's limit of {format_size(len(data) - 1)}; "
        "leave big files out with .gpumeshignore"
    )
    assert _leftovers(jail) == []
    unpack_tar(io.BytesIO(data), jail / "dest", tar_size(plan))
    assert _leftovers(jail) == ["dest"]


def test_limit_stops_a_big_file_before_its_content(tmp_path: Path) -> None:
    root = make(tmp_path / "r", {"small": "x", "weights.bin": b"\0" * 3_000_000})
    source = _StreamOnly(tar_bytes(scan(root)))
    with pytest.raises(LimitError):
        unpack_tar(source, tmp_path / "dest", 100_000)  # type: ignore[arg-type]
    assert source.read_bytes < 100_000
    assert _leftovers(tmp_path) == ["r"]


def test_limit_counts_headers_while_streaming(tmp_path: Path) -> None:
    # No content at all, yet the stream is long: the reader's count stops it.
    root = make(tmp_path / "r", {f"empty{i}": "" for i in range(100)})
    source = _StreamOnly(tar_bytes(scan(root)))
    with pytest.raises(LimitError):
        unpack_tar(source, tmp_path / "dest", 20_000)  # type: ignore[arg-type]
    assert source.read_bytes < 20_000 + tarfile.RECORDSIZE
    assert _leftovers(tmp_path) == ["r"]


# --- unpacking: hostile archives ----------------------------------------------------------------

Member = tuple[str, bytes | None, Callable[[tarfile.TarInfo], None] | None]


def hostile(*members: tuple[str, str, object]) -> bytes:
    """A tar built entry by entry: (name, kind, content-or-link-target)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name, kind, value in members:
            info = tarfile.TarInfo(name)
            info.mode = 0o644
            data = None
            if kind == "file":
                assert isinstance(value, bytes)
                data, info.size = io.BytesIO(value), len(value)
            elif kind == "dir":
                info.type = tarfile.DIRTYPE
            elif kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, str(value)
            elif kind == "hardlink":
                info.type, info.linkname = tarfile.LNKTYPE, str(value)
            elif kind == "fifo":
                info.type = tarfile.FIFOTYPE
            elif kind == "chr":
                info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
            elif kind == "blk":
                info.type, info.devmajor, info.devminor = tarfile.BLKTYPE, 8, 0
            elif kind == "pax":
                info.pax_headers = {"comment": "x" * int(str(value))}
                data, info.size = io.BytesIO(b""), 0
            archive.addfile(info, data)
    return out.getvalue()


@pytest.fixture
def jail(tmp_path: Path) -> Path:
    """The folder dest goes in; tmp_path around it stands for the rest of the disk."""
    (tmp_path / "jail").mkdir()
    return tmp_path / "jail"


def refused(jail: Path, data: bytes) -> str:
    outside_before = _leftovers(jail.parent)
    with pytest.raises(ProtocolError) as caught:
        unpack_tar(io.BytesIO(data), jail / "dest", BIG)
    assert _leftovers(jail) == []  # neither dest nor the temporary folder
    assert _leftovers(jail.parent) == outside_before
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_absolute_name(jail: Path) -> None:
    target = jail.parent / "evil"
    message = refused(jail, hostile(("ok", "file", b"1"), (str(target), "file", b"x")))
    assert message == f"refused the upload: entry {str(target)!r} has an absolute path"
    assert not target.exists()


@pytest.mark.parametrize("name", ["../evil", "a/../../evil", "a/../b", "..", "./../evil"])
def test_dot_dot(jail: Path, name: str) -> None:
    message = refused(jail, hostile(("a/", "dir", None), (name, "file", b"x")))
    assert message == f"refused the upload: entry {name!r} climbs out with '..'"
    assert not (jail.parent / "evil").exists()


@pytest.mark.parametrize(
    ("name", "target"),
    [("l", "/etc"), ("l", ".."), ("d/l", "../../evil"), ("l", "a/../../evil"), ("l", "")],
)
def test_symlink_out(jail: Path, name: str, target: str) -> None:
    message = refused(jail, hostile((name, "symlink", target)))
    assert message == (
        f"refused the upload: entry {name!r} is a symlink to {target!r}, outside the folder"
    )


def test_write_through_a_symlink(jail: Path) -> None:
    message = refused(
        jail, hostile(("sub/", "dir", None), ("l", "symlink", "sub"), ("l/x", "file", b"x"))
    )
    assert message == "refused the upload: entry 'l/x' is inside 'l', which is a symlink"


def test_two_links_that_escape_together(jail: Path) -> None:
    # Each is inside on its own; together a -> b/.. -> ./.. is the parent.
    message = refused(jail, hostile(("a", "symlink", "b/.."), ("b", "symlink", ".")))
    assert message == "refused the upload: symlink 'a' leads outside the folder"


@pytest.mark.parametrize("target", ["../evil", "/etc/passwd", "later", "sub", "nowhere"])
def test_hard_link_refused(jail: Path, target: str) -> None:
    message = refused(
        jail,
        hostile(("sub/", "dir", None), ("h", "hardlink", target), ("later", "file", b"x")),
    )
    assert message == (
        "refused the upload: entry 'h' is a hard link to something not extracted before it"
    )


def test_hard_link_inside_is_fine(jail: Path) -> None:
    data = hostile(("a/f", "file", b"data"), ("h", "hardlink", "a/f"))
    unpack_tar(io.BytesIO(data), jail / "dest", BIG)
    assert (jail / "dest" / "h").read_bytes() == b"data"


@pytest.mark.parametrize(
    ("kind", "why"), [("fifo", "is a named pipe"), ("chr", "is a device"), ("blk", "is a device")]
)
def test_special_entries(jail: Path, kind: str, why: str) -> None:
    message = refused(jail, hostile(("ok", "file", b"1"), ("dev", kind, None)))
    assert message == f"refused the upload: entry 'dev' {why}"


def test_same_name_twice(jail: Path) -> None:
    message = refused(jail, hostile(("f", "file", b"1"), ("f", "symlink", "g")))
    assert message == "refused the upload: entry 'f' appears twice"


def test_a_folder_twice_is_fine(jail: Path) -> None:
    unpack_tar(
        io.BytesIO(hostile(("d/x", "file", b"1"), ("d", "dir", None), ("d/", "dir", None))),
        jail / "dest",
        BIG,
    )
    assert (jail / "dest" / "d" / "x").read_bytes() == b"1"


def test_a_file_used_as_a_folder(jail: Path) -> None:
    message = refused(jail, hostile(("f", "file", b"1"), ("f/x", "file", b"2")))
    assert message == "refused the upload: entry 'f/x' is inside 'f', which is a file"


def test_huge_pax_header(jail: Path) -> None:
    message = refused(jail, hostile(("x", "pax", 2_000_000)))
    assert message == "refused the upload: a 2MB tar header; it was not made by gpumesh"


def test_dot_entry_is_the_destination_itself(jail: Path) -> None:
    unpack_tar(io.BytesIO(hostile((".", "dir", None), ("./a", "file", b"1"))), jail / "d", BIG)
    assert (jail / "d" / "a").read_bytes() == b"1"


def test_set_id_and_group_write_bits_are_dropped(jail: Path) -> None:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as archive:
        info = tarfile.TarInfo("tool")
        info.mode, info.size = 0o6777, 1
        archive.addfile(info, io.BytesIO(b"x"))
    out.seek(0)
    unpack_tar(out, jail / "dest", BIG)
    assert stat.S_IMODE((jail / "dest" / "tool").stat().st_mode) == 0o755


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not a tar at all" * 100,
        gzip.compress(hostile(("a", "file", b"1"))),
        hostile(("a", "file", b"1" * 5000))[:2000],
        hostile(("a", "file", b"1"))[:100],
    ],
    ids=["empty", "garbage", "gzip", "cut in content", "cut in header"],
)
def test_not_a_complete_tar(jail: Path, data: bytes) -> None:
    message = refused(jail, data)
    assert message.startswith("refused the upload: not a complete tar archive (")


def test_a_write_error_is_the_providers(jail: Path) -> None:
    # A name too long for the provider's file system: the peer gets a clear refusal.
    data = hostile(("n" * 300, "file", b"x"))
    with pytest.raises(AgentError) as caught:
        unpack_tar(io.BytesIO(data), jail / "dest", BIG)
    assert str(caught.value) == "the provider could not write the upload: File name too long"
    assert _leftovers(jail) == []


def test_refusals_keep_what_was_outside(jail: Path) -> None:
    (jail.parent / "evil").write_text("original")
    refused(jail, hostile(("ok", "file", b"1"), ("../evil", "file", b"overwritten")))
    assert (jail.parent / "evil").read_text() == "original"


def test_skipped_entries_are_frozen_records() -> None:
    entry = Skipped("a/", "default rule '.git/'")
    with pytest.raises(AttributeError):
        entry.reason = "x"  # type: ignore[misc]
    assert DEFAULT_IGNORES[-1] == "*.pyc"


def test_the_defaults_regex_is_what_pathspec_makes_of_the_default_rules() -> None:
    from gpumesh.files.pack import DEFAULTS_REGEX, _IgnoreRules

    rules = _IgnoreRules([])
    rules._compile()  # what pathspec makes of DEFAULT_IGNORES, joined
    assert rules._any is not None
    assert rules._any.pattern == DEFAULTS_REGEX
