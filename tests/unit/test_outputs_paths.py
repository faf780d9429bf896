"""What a provider names in its outputs list is hostile: where an entry may land
on the submitter's machine (:func:`entry_problem`, :func:`_prepare_local`), with
real folders and links on this machine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpumesh.client.outputs import _prepare_local, entry_problem
from gpumesh.errors import ConfigError


@pytest.mark.parametrize(
    "path",
    [
        "",
        "/etc/passwd",
        "../escape",
        "a/../../escape",
        "a/./b",
        "a//b",
        "a/",
        ".",
        "..",
        "ok/..",
        "nul\0byte",
        "model.pt.gpumesh-part",
    ],
)
def test_an_entry_that_is_no_plain_relative_path_is_refused(path: str) -> None:
    assert entry_problem(path) is not None


@pytest.mark.parametrize("path", ["model.pt", "ckpt/epoch-3/model.pt", "a b/ü.txt", ".hidden"])
def test_a_plain_relative_path_is_taken(path: str) -> None:
    assert entry_problem(path) is None


def test_folders_are_made_under_the_root_and_a_new_file_is_told_apart(tmp_path: Path) -> None:
    root = tmp_path / "out"
    target, new = _prepare_local(root, "ckpt/epoch-3/model.pt")
    assert target == root / "ckpt" / "epoch-3" / "model.pt" and new
    assert (root / "ckpt" / "epoch-3").is_dir()
    target.write_bytes(b"x")
    assert _prepare_local(root, "ckpt/epoch-3/model.pt") == (target, False)


def test_a_link_on_the_way_here_is_never_followed(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    os.symlink(elsewhere, root / "ckpt")
    with pytest.raises(ConfigError, match="is a link here"):
        _prepare_local(root, "ckpt/model.pt")
    assert list(elsewhere.iterdir()) == []


def test_a_file_where_a_folder_is_needed_or_a_folder_at_the_files_place_is_refused(
    tmp_path: Path,
) -> None:
    root = tmp_path / "out"
    root.mkdir()
    (root / "ckpt").write_bytes(b"a file")
    with pytest.raises(ConfigError, match="is a file here"):
        _prepare_local(root, "ckpt/model.pt")
    (root / "folder").mkdir()
    with pytest.raises(ConfigError, match="is a folder here"):
        _prepare_local(root, "folder")
