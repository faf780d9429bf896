"""Where a home is: always an absolute path, whatever form it was given in."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumesh.settings import ENV_HOME, home_dir
from gpumesh.store.home import Home


def test_a_relative_home_is_made_absolute_from_the_working_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert home_dir("h") == tmp_path / "h"
    monkeypatch.setenv(ENV_HOME, "env-home")
    assert home_dir() == tmp_path / "env-home"
    # What the provider hands Docker as a job's folders is absolute in turn.
    assert Home("h").files_dir == tmp_path / "h" / "files"
    assert Home("h").files_dir.is_absolute()
