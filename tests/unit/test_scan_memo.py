"""A folder's scan reused by the next one (``ScanMemo``), and the consumer's own
cache and state files held in memory while their stamp stays the same."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from gpumesh.client import apps
from gpumesh.files.pack import PackPlan, ScanMemo, scan


def _plan(plan: PackPlan) -> tuple[object, ...]:
    return (plan.files, plan.skipped)


def test_a_memo_gives_the_plan_a_fresh_scan_gives_after_each_kind_of_change(
    tmp_path: Path,
) -> None:
    root = tmp_path / "proj"
    (root / "src").mkdir(parents=True)
    for index in range(20):
        (root / "src" / f"f{index}.py").write_text(f"x = {index}\n")
    (root / "data.bin").write_bytes(b"d" * 100)
    memo = ScanMemo()
    first = scan(root, memo=memo)
    assert _plan(first) == _plan(scan(root))

    again = scan(root, memo=memo)
    assert _plan(again) == _plan(first)
    # Unchanged files were not decided again: the very same entries came back.
    assert all(a is b for a, b in zip(again.files, first.files, strict=True) if a.kind == "file")

    changes: list[Callable[[], object]] = [
        lambda: (root / "src" / "f1.py").write_text("x = 'longer now'\n"),  # size
        lambda: os.utime(root / "src" / "f2.py", ns=(1, 10**18)),  # mtime only
        lambda: (root / "src" / "f3.py").chmod(0o755),  # mode only
        (root / "src" / "f4.py").unlink,
        lambda: (root / "new.txt").write_text("new"),
        lambda: (root / ".gpumeshignore").write_text("*.bin\n"),  # rules change
        lambda: (root / ".gpumeshignore").write_text("src/f5.py\n"),
    ]
    for change in changes:
        change()
        assert _plan(scan(root, memo=memo)) == _plan(scan(root))
    paths = [entry.path for entry in scan(root, memo=memo).files]
    assert "data.bin" in paths and "src/f5.py" not in paths and "src/f4.py" not in paths


def test_held_files_are_read_again_when_another_writer_changed_them(tmp_path: Path) -> None:
    path = tmp_path / "sync-state.json"
    apps._write_held(path, apps._State("a" * 64, {"f.txt": (1, 0o644, "b" * 64)}))
    assert apps._load_state(path) == ("a" * 64, {"f.txt": (1, 0o644, "b" * 64)})
    # Another process (an in-process command beside the node process) rewrites it.
    other = tmp_path / "other.json"
    other.write_bytes(b'{"digest":"' + b"c" * 64 + b'","files":{}}')
    os.replace(other, path)
    assert apps._load_state(path) == ("c" * 64, {})
    path.unlink()
    assert apps._load_state(path) is None


def _tree(root: Path) -> None:
    for folder in ("a", "b", "b/deep", "c"):
        (root / folder).mkdir(parents=True)
        for index in range(5):
            (root / folder / f"f{index}.txt").write_text(f"{folder} {index}\n")


def test_a_watched_memo_lists_only_changed_folders_and_sees_every_kind_of_change(
    tmp_path: Path,
) -> None:
    """Kernel notice (inotify) of changes: a re-scan lists again only the folders
    that changed (and their parents), and its plan is a fresh scan's after each
    kind of change: content, size, mtime, mode, new, deleted and renamed files,
    folders made, removed and moved, ignore rules, links."""
    from gpumesh.files.watch import open_watch

    root = tmp_path / "proj"
    _tree(root)
    os.link(root / "a" / "f0.txt", tmp_path / "outside")  # a file with another name
    probe = os.open(root, os.O_RDONLY)
    try:
        available = open_watch(probe) is not None
    finally:
        os.close(probe)
    memo = ScanMemo(watch=True)
    assert _plan(scan(root, memo=memo)) == _plan(scan(root))
    assert memo.listed == 5
    assert _plan(scan(root, memo=memo)) == _plan(scan(root))
    # Nothing changed: nothing listed but a (its f0.txt may be written through
    # its other name, which a watch of a does not see).
    assert memo.listed == (1 if available else 5)

    (root / "b" / "deep" / "f1.txt").write_text("b deep 1 rewritten\n")
    assert _plan(scan(root, memo=memo)) == _plan(scan(root))
    assert memo.listed == (4 if available else 5)  # b/deep, b, the root; and a

    def same_size() -> None:  # same size, new content: the mtime tells
        with (root / "a" / "f2.txt").open("r+") as handle:
            handle.write("A")

    changes: list[Callable[[], object]] = [
        same_size,
        lambda: os.utime(root / "c" / "f0.txt", ns=(1, 10**18)),
        lambda: (root / "c" / "f1.txt").chmod(0o755),
        lambda: (root / "a" / "new.txt").write_text("new"),
        (root / "a" / "f3.txt").unlink,
        lambda: (root / "c" / "f2.txt").rename(root / "c" / "moved.txt"),
        (root / "b" / "deep" / "more").mkdir,
        lambda: (root / "b" / "deep" / "more" / "g.txt").write_text("g"),
        lambda: (root / "b" / "deep").rename(root / "c" / "deep"),
        lambda: (root / "c" / "deep" / "more" / "g.txt").write_text("g again, longer"),
        lambda: (root / ".gpumeshignore").write_text("*.md\n"),
        lambda: (root / "c" / "notes.md").write_text("ignored"),
        lambda: (root / "c" / "link").symlink_to("f0.txt"),
        lambda: (root / "c" / "f0.txt").write_text("through the link's target\n"),
        lambda: (tmp_path / "outside").write_text("written through another folder\n"),
        lambda: shutil.rmtree(root / "c" / "deep"),
    ]
    for change in changes:
        change()
        assert _plan(scan(root, memo=memo)) == _plan(scan(root))
    # Without a change, still nothing is listed but the folders whose decisions
    # never last (c has a symlink, a a file with another link).
    scan(root, memo=memo)
    assert memo.listed == (2 if available else 4)


def test_a_watched_memo_sees_a_file_written_through_a_link_made_after_its_folder_was_listed(
    tmp_path: Path,
) -> None:
    """A second name made in another watched folder, then written through: the
    file's own folder saw nothing (link and write are told to the other folder
    only), so a new link makes the scan list every folder once."""
    root = tmp_path / "proj"
    _tree(root)
    memo = ScanMemo(watch=True)
    scan(root, memo=memo)
    scan(root, memo=memo)  # everything held by the watch now
    os.link(root / "a" / "f1.txt", root / "c" / "other-name.txt")
    assert _plan(scan(root, memo=memo)) == _plan(scan(root))
    (root / "c" / "other-name.txt").write_text("written through the second name, longer\n")
    plan = scan(root, memo=memo)
    assert _plan(plan) == _plan(scan(root))
    by_path = {entry.path: entry for entry in plan.files}
    assert by_path["a/f1.txt"].size == len("written through the second name, longer\n")


def test_a_plan_puts_each_folder_right_before_its_contents(tmp_path: Path) -> None:
    root = tmp_path / "proj"
    for path in ("a/x.txt", "a-b/y.txt", "a.txt", "a/b/z.txt", "a b/w.txt", "ab/v.txt"):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(path)
    for memo in (None, ScanMemo(), ScanMemo(watch=True)):
        paths = [entry.path for entry in scan(root, memo=memo).files]
        assert paths == sorted(paths, key=lambda path: path.split("/"))
        assert paths.index("a") + 1 == paths.index("a/b")


def test_a_tree_the_watch_cannot_hold_is_scanned_as_without_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpumesh.files import watch

    monkeypatch.setattr(watch, "MAX_FOLDERS", 2)
    root = tmp_path / "proj"
    _tree(root)
    memo = ScanMemo(watch=True)
    assert _plan(scan(root, memo=memo)) == _plan(scan(root))
    assert memo.watch is None and not memo.watching and memo.folders == {}
    (root / "c" / "f1.txt").write_text("seen without a watch\n")
    assert _plan(scan(root, memo=memo)) == _plan(scan(root))
