"""A folder's scan reused by the next one (``ScanMemo``), and the consumer's own
cache and state files held in memory while their stamp stays the same."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

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
    apps._save_state(path, "a" * 64, {"f.txt": (1, 0o644, "b" * 64)})
    assert apps._load_state(path) == ("a" * 64, {"f.txt": (1, 0o644, "b" * 64)})
    # Another process (an in-process command beside the node process) rewrites it.
    other = tmp_path / "other.json"
    other.write_bytes(b'{"digest":"' + b"c" * 64 + b'","files":{}}')
    os.replace(other, path)
    assert apps._load_state(path) == ("c" * 64, {})
    path.unlink()
    assert apps._load_state(path) is None
