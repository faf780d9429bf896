"""The sandbox's file system layer: nothing below a tree's root is ever followed as a link.

Every test runs twice: with ``openat2`` (RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)
and with the component walk older kernels get. Races are reproduced at the
instant a name-based implementation would have between check and use, through
the module's pause points (a hook swaps folders for symlinks right there).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpumesh.errors import LimitError
from gpumesh.files import sandbox
from gpumesh.files.sandbox import MAX_DEPTH, Tree, open_beneath, openat2_available


@pytest.fixture
def hook() -> Iterator[Callable[[Callable[[str, str], None]], None]]:
    def install(function: Callable[[str, str], None]) -> None:
        sandbox._Seam.hook = function

    try:
        yield install
    finally:
        sandbox._Seam.hook = None


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path]:
    """A tree root and an 'outside' folder holding a secret, side by side."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "identity.key").write_text("SECRET KEY")
    return root, outside


def _swap_for_link(folder: Path, target: Path) -> Path:
    """What a hostile job does: move ``folder`` aside and put a symlink in its place."""
    moved = folder.with_name(folder.name + ".moved")
    folder.rename(moved)
    folder.symlink_to(target)
    return moved


def test_openat2_is_used_where_the_kernel_has_it() -> None:
    # This machine's kernel (5.6+) must take the fast path; the walk is the fallback.
    sandbox.use_openat2(None)
    assert openat2_available()


def test_links_are_refused_at_every_component(resolution: str, layout: tuple[Path, Path]) -> None:
    root, outside = layout
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f").write_text("mine")
    (root / "a" / "link").symlink_to(outside)
    (root / "a" / "b" / "flink").symlink_to(outside / "identity.key")
    (root / "inner").symlink_to("a")  # even a link that stays inside is not followed
    with Tree(root) as tree:
        fd = tree.open_file(("a", "b", "f"))
        assert os.read(fd, 10) == b"mine"
        os.close(fd)
        for parts in [("a", "link", "identity.key"), ("a", "b", "flink"), ("inner", "b", "f")]:
            with pytest.raises(OSError) as caught:
                tree.open_file(parts)
            assert caught.value.errno == errno.ELOOP, parts
        with pytest.raises(OSError) as caught:
            tree.open_dir(("a", "link"))
        assert caught.value.errno == errno.ELOOP
        with pytest.raises(OSError) as caught:
            tree.open_file(("a", "b", "f", "x"))
        assert caught.value.errno == errno.ENOTDIR
        with pytest.raises(FileNotFoundError):
            tree.open_file(("a", "nothing"))
        with pytest.raises(OSError) as caught:
            tree.open_file(("a",))
        assert caught.value.errno == errno.EISDIR


def test_a_named_pipe_never_blocks_an_open(resolution: str, layout: tuple[Path, Path]) -> None:
    root, _ = layout
    os.mkfifo(root / "pipe")
    with Tree(root) as tree, pytest.raises(OSError) as caught:
        tree.open_file(("pipe",))
    assert caught.value.errno == errno.EPERM


def test_a_folder_swapped_mid_walk_of_the_components_is_refused(
    resolution: str, layout: tuple[Path, Path], hook
) -> None:
    root, outside = layout
    (root / "r").mkdir()
    (root / "r" / "identity.key").write_text("decoy")

    def swap(where: str, name: str) -> None:
        if where == "component" and name == "r":
            _swap_for_link(root / "r", outside)

    hook(swap)
    with Tree(root) as tree:
        try:
            fd = tree.open_file(("r", "identity.key"))
        except OSError as exc:
            assert exc.errno == errno.ELOOP
        else:  # openat2 resolves the whole path at once: it saw the folder as it was
            assert resolution == "openat2"
            assert os.read(fd, 100) == b"decoy"
            os.close(fd)


def test_place_lands_in_the_folder_that_was_opened_never_through_a_link(
    resolution: str, layout: tuple[Path, Path], tmp_path: Path, hook
) -> None:
    root, outside = layout
    (root / "d").mkdir()
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "upload.part").write_text("payload")
    moved: list[Path] = []

    def swap(where: str, name: str) -> None:
        if where == "place":
            moved.append(_swap_for_link(root / "d", outside))

    hook(swap)
    staging_fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with Tree(root) as tree:
            tree.place(staging_fd, "upload.part", ("d", "x"))
    finally:
        os.close(staging_fd)
    assert sorted(p.name for p in outside.iterdir()) == ["identity.key"]
    assert (moved[0] / "x").read_text() == "payload"  # the folder it opened, moved aside


def test_place_makes_missing_folders_and_replaces_a_link_not_its_target(
    resolution: str, layout: tuple[Path, Path], tmp_path: Path
) -> None:
    root, outside = layout
    (root / "f").symlink_to(outside / "identity.key")
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "a").write_text("new")
    (staging / "b").write_text("deep")
    fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with Tree(root) as tree:
            tree.place(fd, "a", ("f",))
            tree.place(fd, "b", ("n", "e", "w"))
    finally:
        os.close(fd)
    assert not (root / "f").is_symlink() and (root / "f").read_text() == "new"
    assert (outside / "identity.key").read_text() == "SECRET KEY"
    assert (root / "n" / "e" / "w").read_text() == "deep"


def test_creating_folders_through_a_link_is_refused(
    resolution: str, layout: tuple[Path, Path]
) -> None:
    root, outside = layout
    (root / "d").symlink_to(outside)
    with Tree(root) as tree, pytest.raises(OSError) as caught:
        tree.open_dir(("d", "new"), create=True)
    assert caught.value.errno == errno.ELOOP
    assert sorted(p.name for p in outside.iterdir()) == ["identity.key"]


def test_a_walk_never_leaves_the_tree_even_when_folders_are_swapped(
    resolution: str, layout: tuple[Path, Path], hook
) -> None:
    root, outside = layout
    (root / "a").mkdir()
    (root / "a" / "one").write_bytes(b"1" * 10)
    (root / "b").mkdir()
    (root / "b" / "two").write_bytes(b"2" * 20)
    (root / "l").symlink_to(outside)
    (outside / "big").write_bytes(b"x" * 1000)

    def swap(where: str, name: str) -> None:
        if where == "walk" and name == "b":
            _swap_for_link(root / "b", outside)

    hook(swap)
    listing: dict[str, tuple[int, int]] = {}
    with Tree(root) as tree:
        total = tree.tally(((), listing))
    # "b" became a link just before it was opened: skipped, never followed.
    assert total == 10
    assert set(listing) == {"a/one"}


def test_tally_lists_paths_from_the_folder_asked_for(layout: tuple[Path, Path]) -> None:
    root, _ = layout
    (root / "apps" / "x" / "sub").mkdir(parents=True)
    (root / "apps" / "x" / "sub" / "f").write_bytes(b"abc")
    (root / "apps" / "x" / "g").write_bytes(b"de")
    (root / "other").write_bytes(b"1234")
    listing: dict[str, tuple[int, int]] = {}
    with Tree(root) as tree:
        assert tree.tally((("apps", "x"), listing)) == 9  # the whole tree counts
    assert set(listing) == {"sub/f", "g"}
    assert listing["g"][0] == 2


def test_folders_nested_past_the_limit_are_refused(layout: tuple[Path, Path]) -> None:
    root, _ = layout
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(MAX_DEPTH + 2):  # deeper than PATH_MAX allows by name
        os.mkdir("d", dir_fd=fd)
        child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    os.close(fd)
    with Tree(root) as tree, pytest.raises(LimitError, match=f"deeper than {MAX_DEPTH}"):
        tree.tally()


def test_merge_moves_entries_and_never_writes_through_a_swapped_folder(
    resolution: str, layout: tuple[Path, Path], tmp_path: Path, hook
) -> None:
    root, outside = layout
    (root / "dest" / "keep").mkdir(parents=True)
    (root / "dest" / "keep" / "old").write_text("old")
    (root / "dest" / "sub").mkdir()
    staging = tmp_path / "staging"
    (staging / "up" / "keep").mkdir(parents=True)
    (staging / "up" / "keep" / "new").write_text("new")
    (staging / "up" / "sub").mkdir()
    (staging / "up" / "sub" / "evil").write_text("should not leave")

    def swap(where: str, name: str) -> None:
        if where == "merge" and name == "sub":
            _swap_for_link(root / "dest" / "sub", outside)

    hook(swap)
    fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
    try:
        # Refusing is fine; writing outside is not.
        with Tree(root) as tree, contextlib.suppress(OSError):
            tree.place_tree(fd, "up", ("dest",))
    finally:
        os.close(fd)
    assert sorted(p.name for p in outside.iterdir()) == ["identity.key"]
    assert (root / "dest" / "keep" / "new").read_text() == "new"
    assert (root / "dest" / "keep" / "old").read_text() == "old"


def test_place_tree_renames_a_new_folder_and_refuses_a_file_or_link(
    resolution: str, layout: tuple[Path, Path], tmp_path: Path
) -> None:
    root, outside = layout
    staging = tmp_path / "staging"
    for name in ("one", "two", "three"):
        (staging / name).mkdir(parents=True)
        (staging / name / "f").write_text(name)
    (root / "file").write_text("a file")
    (root / "link").symlink_to(outside)
    fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with Tree(root) as tree:
            tree.place_tree(fd, "one", ("new", "folder"))
            for name, target in (("two", "file"), ("three", "link")):
                with pytest.raises(NotADirectoryError):
                    tree.place_tree(fd, name, (target,))
    finally:
        os.close(fd)
    assert (root / "new" / "folder" / "f").read_text() == "one"
    assert sorted(p.name for p in outside.iterdir()) == ["identity.key"]


def test_unlink_removes_files_and_links_never_through_a_link(
    resolution: str, layout: tuple[Path, Path], hook
) -> None:
    root, outside = layout
    (outside / "old.txt").write_text("outside")
    (root / "sub").mkdir()
    (root / "sub" / "old.txt").write_text("inside")
    (root / "gone").mkdir()
    (root / "gone" / "old.txt").write_text("inside too")

    def swap(where: str, name: str) -> None:
        if where == "unlink" and not (root / "sub").is_symlink():
            _swap_for_link(root / "sub", outside)

    with Tree(root) as tree:
        assert tree.unlink(("gone", "old.txt"))
        assert not tree.unlink(("gone",))  # a folder is never unlinked
        hook(swap)
        # the parent was opened before the swap: the file in the moved folder goes
        tree.unlink(("sub", "old.txt"))
        assert not tree.unlink(("sub", "old.txt"))  # now a link: refused, not followed
    assert (outside / "old.txt").read_text() == "outside"
    assert not (root / "sub.moved" / "old.txt").exists()


def test_prune_empty_removes_empty_folders_up_to_the_stop(layout: tuple[Path, Path]) -> None:
    root, _ = layout
    (root / "apps" / "x" / "a" / "b").mkdir(parents=True)
    (root / "apps" / "x" / "keep").mkdir()
    (root / "apps" / "x" / "keep" / "f").write_text("f")
    with Tree(root) as tree:
        tree.prune_empty(("apps", "x", "a", "b", "file"), stop=2)
        tree.prune_empty(("apps", "x", "keep", "f"), stop=2)
    assert not (root / "apps" / "x" / "a").exists()
    assert (root / "apps" / "x" / "keep").is_dir()


def test_chown_all_changes_only_what_lies_in_the_tree(
    resolution: str, layout: tuple[Path, Path], hook
) -> None:
    if os.geteuid() != 0:
        pytest.skip("changing owners needs root")
    root, outside = layout
    (root / "w" / "d").mkdir(parents=True)
    (root / "w" / "d" / "f").write_text("mine")
    (root / "w" / "e").mkdir()
    (root / "w" / "e" / "g").write_text("mine too")
    (root / "w" / "l").symlink_to(outside / "identity.key")
    (outside / "sub").mkdir()
    before = {p: (p.lstat().st_uid, p.lstat().st_mode) for p in outside.rglob("*")}

    def swap(where: str, name: str) -> None:
        if where == "walk" and name == "e":
            _swap_for_link(root / "w" / "e", outside)

    hook(swap)
    with Tree(root) as tree:
        tree.chown_all(("w",), (47000, 47000))
    assert (root / "w" / "d" / "f").stat().st_uid == 47000
    assert (root / "w" / "d").stat().st_uid == 47000
    assert (root / "w" / "l").lstat().st_uid == 47000  # the link itself
    after = {p: (p.lstat().st_uid, p.lstat().st_mode) for p in outside.rglob("*")}
    assert after == before
    assert outside.stat().st_uid == 0


def test_open_beneath_never_climbs_out(resolution: str, layout: tuple[Path, Path]) -> None:
    root, _ = layout
    (root / "a").mkdir()
    fd = os.open(root / "a", os.O_RDONLY | os.O_DIRECTORY)
    try:
        # Callers pass checked names; were a '..' or a '/' to slip through, it still
        # could not leave.
        for parts in [("..", "outside", "identity.key"), ("/etc/passwd",), ("a/../..",)]:
            with pytest.raises(OSError) as caught:
                open_beneath(fd, parts, os.O_RDONLY)
            assert caught.value.errno == errno.EXDEV
    finally:
        os.close(fd)
