"""Remote paths of `gpumesh cp`: every one lands inside the peer's sandbox or is refused.

:func:`sandbox_parts` / :func:`sandbox_path` are pure (no file system); on a
real folder, the service refuses every path with a symlink on it.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumesh.agent.deps import Provider
from gpumesh.agent.files import FileService, sandbox_parts, sandbox_path
from gpumesh.client.files import parse_location
from gpumesh.errors import AccessDeniedError, ConfigError, GPUMeshError

ROOT = Path("/srv/gpumesh/files/peer")


@pytest.mark.parametrize(
    ("remote", "parts"),
    [
        ("", ()),
        ("/", ()),
        (".", ()),
        ("//./", ()),
        ("data.bin", ("data.bin",)),
        ("/data.bin", ("data.bin",)),
        ("a/b/c", ("a", "b", "c")),
        ("/a//b/./c/", ("a", "b", "c")),
        ("/etc/passwd", ("etc", "passwd")),  # "/" is the sandbox root, never the host's
        ("~/x", ("~", "x")),  # no shell expansion: "~" is a name
        ("...", ("...",)),
        ("..a/b..", ("..a", "b..")),
        ("C:", ("C:",)),
        ("été/日本", ("été", "日本")),
        ("x" * 255, ("x" * 255,)),
    ],
)
def test_accepted_paths_and_their_parts(remote: str, parts: tuple[str, ...]) -> None:
    assert sandbox_parts(remote) == parts
    assert sandbox_path(ROOT, remote) == ROOT.joinpath(*parts)


@pytest.mark.parametrize(
    "remote",
    [
        "..",
        "../x",
        "/..",
        "/../etc/passwd",
        "a/../../x",
        "a/b/../../../etc",
        "a/..",  # would stay inside, refused all the same: no '..' at all
        "./../x",
        "x/./../..",
        "//..//x",
    ],
)
def test_every_dot_dot_is_refused(remote: str) -> None:
    with pytest.raises(AccessDeniedError, match=r"'\.\.'"):
        sandbox_parts(remote)


@pytest.mark.parametrize(
    ("remote", "why"),
    [
        ("a\x00b", "control character"),
        ("x\n", "control character"),
        ("tab\there", "control character"),
        ("del\x7f", "control character"),
        ("..\\..\\windows", "backslash"),
        ("a\\b", "backslash"),
        ("x" * 256, "longer than 255 bytes"),
        ("é" * 128, "longer than 255 bytes"),  # 256 bytes in UTF-8
        ("ok/\ud800", "not valid UTF-8"),
    ],
)
def test_invalid_names_are_refused(remote: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        sandbox_parts(remote)


_PIECES = st.sampled_from(
    ["", ".", "..", "...", "/", "//", "a", "b", "\\", "\x00", "\n", "~", "é", "x" * 200, " "]
)


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(max_size=60), st.lists(_PIECES, max_size=12).map("".join)))
def test_a_resolved_path_is_always_inside_the_sandbox(remote: str) -> None:
    try:
        path = sandbox_path(ROOT, remote)
    except (AccessDeniedError, ConfigError):
        return
    relative = PurePosixPath(path).relative_to(ROOT)  # raises when outside
    assert ".." not in relative.parts
    assert os.path.normpath(path) == str(path)
    assert all(len(part.encode()) <= 255 and "\x00" not in part for part in relative.parts)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", ".", ""]), max_size=8), st.integers(1, 4))
def test_any_dot_dot_anywhere_is_refused(parts: list[str], position: int) -> None:
    parts.insert(min(position, len(parts)), "..")
    with pytest.raises(AccessDeniedError):
        sandbox_parts("/".join(parts))


# --- the symlink check, on a real folder -----------------------------------------------------


@pytest.fixture
def service(tmp_path: Path) -> tuple[FileService, object, Path]:
    provider = Provider(name="alice-pc", node_id="alice", host="127.0.0.1")
    peer = SimpleNamespace(node_id="bobbobbobbobbobbobbobbobbo", name="bob")
    files = FileService(provider, None, None, root=tmp_path / "home" / "files")  # type: ignore[arg-type]
    sandbox = files.sandbox(peer)  # type: ignore[arg-type]
    return files, peer, sandbox


def test_the_sandbox_is_private_to_the_provider(service) -> None:
    files, _peer, sandbox = service
    assert sandbox.stat().st_mode & 0o777 == 0o700
    assert files.root.stat().st_mode & 0o777 == 0o700


def test_every_symlink_on_a_path_is_refused(service, tmp_path: Path) -> None:
    # A link is refused wherever it is on the path, whether it leads out or stays
    # inside: a peer's job can swap any folder for one at any instant, so the
    # sandbox is only ever walked without following links.
    files, peer, sandbox = service
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x").write_text("outside")
    (sandbox / "sub").mkdir()
    (sandbox / "sub" / "x").write_text("inside")
    (sandbox / "out").symlink_to(outside)
    (sandbox / "abs-out").symlink_to("/etc/passwd")
    (sandbox / "up").symlink_to("..")
    (sandbox / "sub" / "upup").symlink_to("../..")
    (sandbox / "devnull").symlink_to("/dev/null")
    (sandbox / "in").symlink_to("sub")
    (sandbox / "abs-in").symlink_to(sandbox / "sub")
    linked = ["out", "out/x", "/abs-out", "up", "up/other-peer/x", "sub/upup/x", "devnull"]
    linked += ["in", "in/x", "abs-in", "abs-in/x"]
    never_followed = "a symlink is on that path, and links in your folder are never followed"
    for remote in linked:
        with pytest.raises(AccessDeniedError, match=never_followed):
            files._stat(peer, remote)
        with pytest.raises(AccessDeniedError, match=never_followed):
            files.open_regular(peer, remote)
    assert files._stat(peer, "/").kind == "dir"
    assert files._stat(peer, "sub").kind == "dir"
    fd = files.open_regular(peer, "sub/x")
    assert os.read(fd, 100) == b"inside"
    os.close(fd)


def test_refusals_name_the_provider(service) -> None:
    files, peer, _sandbox = service
    with pytest.raises(GPUMeshError, match=r"^alice-pc refused '\.\./x'"):
        files.parts("../x")
    with pytest.raises(GPUMeshError, match=r"^alice-pc refused '\.\./x'"):
        files._stat(peer, "../x")


@pytest.mark.parametrize(
    ("text", "peer", "path"),
    [
        ("alice-pc:/data.bin", "alice-pc", "/data.bin"),
        ("alice-pc:", "alice-pc", ""),
        ("abcd:x/y", "abcd", "x/y"),
        ("./dataset.bin", None, "./dataset.bin"),
        ("/tmp/a:b", None, "/tmp/a:b"),
        ("./a:b", None, "./a:b"),
        ("plain", None, "plain"),
        (":x", None, ":x"),
    ],
)
def test_peer_or_local(text: str, peer: str | None, path: str) -> None:
    location = parse_location(text)
    assert (location.peer, location.path) == (peer, path)
