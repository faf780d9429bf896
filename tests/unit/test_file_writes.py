"""How received bytes go into files: whole, in bounded writes, and without an
ext4 "replace" truncation of a file that needs none."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from gpumesh import platform
from gpumesh.files.transfer import truncate_at


def test_write_all_writes_every_byte_across_slices(tmp_path: Path) -> None:
    data = os.urandom(2 * platform.WRITE_SLICE + 12_345)
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"head")
        platform.write_all(fd, memoryview(data))
    finally:
        os.close(fd)
    assert path.read_bytes() == b"head" + data


def test_write_all_makes_no_write_larger_than_a_slice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real write, recorded: the size of each call is what the page cache sees.
    sizes: list[int] = []
    real_write = os.write

    def recording(fd: int, data: Any) -> int:
        sizes.append(len(data))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", recording)
    data = os.urandom(3 * platform.WRITE_SLICE + 1)
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        platform.write_all(fd, memoryview(data))
    finally:
        os.close(fd)
    monkeypatch.undo()
    assert path.read_bytes() == data
    assert max(sizes) <= platform.WRITE_SLICE
    assert sum(sizes) == len(data)


def test_truncate_at_drops_what_lies_past_the_offset(tmp_path: Path) -> None:
    path = tmp_path / "part"
    path.write_bytes(b"kept" + b"cut short")
    fd = os.open(path, os.O_RDWR)
    try:
        truncate_at(fd, 4)
        os.write(fd, b"+new")
    finally:
        os.close(fd)
    assert path.read_bytes() == b"kept+new"


def test_truncate_at_leaves_a_file_that_ends_at_the_offset_untruncated(tmp_path: Path) -> None:
    # ftruncate always stamps the file's mtime; on ext4 truncating an empty file
    # also marks it for a write-back of everything written before its close.
    for content in (b"", b"kept"):
        path = tmp_path / f"part{len(content)}"
        path.write_bytes(content)
        os.utime(path, (1_000_000, 1_000_000))
        fd = os.open(path, os.O_RDWR)
        try:
            truncate_at(fd, len(content))
            assert os.lseek(fd, 0, os.SEEK_CUR) == len(content)
        finally:
            os.close(fd)
        assert path.stat().st_mtime == 1_000_000
