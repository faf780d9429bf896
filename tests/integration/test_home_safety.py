"""A home is trusted only when its user owns it and nobody else may write in it, and
nothing in it is opened through a link: attacked through the real CLI.

Another user who pre-creates the home in a shared folder (the temporary folder
the help's examples once used), a world-writable home, and a link planted as
``gpumesh.db`` are each refused in one line that says what to do.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import OtherUser
from tests.integration.conftest import gpumesh
from tests.integration.test_cli import _one_line_error

pytestmark = pytest.mark.usefixtures("gpumesh_processes")

CONFIG_EXIT = 2
"""What a refused home (a ConfigError) exits with."""
IDENTITY_EXIT = 1
"""What a refused identity key (an IdentityError) exits with."""


@pytest.fixture
def shared_folder() -> Iterator[Path]:
    """A folder every account may create in, sticky like /tmp (removed afterwards)."""
    folder = Path(tempfile.mkdtemp(prefix="gpumesh-shared-", dir="/tmp"))
    folder.chmod(0o1777)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_home_another_user_pre_created_is_refused(
    shared_folder: Path, other_user: OtherUser
) -> None:
    home = shared_folder / "gpumesh"
    made = other_user.run("mkdir", "-m", "755", str(home))
    assert made.returncode == 0, made.stderr
    # init and an in-process command, and one that talks to the node process
    for args in (("init", "--name", "victim"), ("peers",), ("jobs",)):
        _one_line_error(
            gpumesh(home, *args),
            CONFIG_EXIT,
            f"the home {home} belongs to another user (uid {other_user.uid}); GPUMesh "
            "keeps its keys only in a home you own: use your own folder (the default is "
            "~/.gpumesh) with --home or GPUMESH_HOME",
        )
    assert list(home.iterdir()) == []  # no key, no config, no database written there


def test_a_link_another_user_made_to_your_folder_is_refused(
    shared_folder: Path, other_user: OtherUser, tmp_path: Path
) -> None:
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    link = shared_folder / "gpumesh"
    assert other_user.run("ln", "-s", str(mine), str(link)).returncode == 0
    _one_line_error(
        gpumesh(link, "init", "--name", "victim"),
        CONFIG_EXIT,
        f"the home {link} is a link made by another user (uid {other_user.uid})",
    )
    assert list(mine.iterdir()) == []


def test_a_home_writable_by_others_is_refused(tmp_path: Path) -> None:
    home = tmp_path / "open"
    home.mkdir()
    home.chmod(0o777)
    refusal = (
        f"the home {home} is writable by other users (mode 0777), who could plant files "
        f"in it: run `chmod 700 {home}` if only you have used it, or use a new folder"
    )
    _one_line_error(gpumesh(home, "init", "--name", "alice"), CONFIG_EXIT, refusal)
    assert list(home.iterdir()) == []
    home.chmod(0o700)
    assert gpumesh(home, "init", "--name", "alice").returncode == 0
    home.chmod(0o777)  # widened later, by hand or by a tool: refused, not narrowed
    _one_line_error(gpumesh(home, "peers"), CONFIG_EXIT, refusal)
    home.chmod(0o770)
    _one_line_error(gpumesh(home, "peers"), CONFIG_EXIT, "is writable by other users (mode 0770)")


def test_the_home_may_be_a_link_to_a_folder_of_yours(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    assert gpumesh(link, "init", "--name", "alice").returncode == 0
    assert (real / "identity.key").is_file()
    assert gpumesh(link, "peers").returncode == 0


def test_a_planted_database_link_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert gpumesh(home, "init", "--name", "alice").returncode == 0
    target = tmp_path / "someone-elses-file"
    target.write_bytes(b"precious\n")
    target.chmod(0o644)
    for name in ("gpumesh.db", "gpumesh.db-wal", "gpumesh.db-shm"):
        (home / name).unlink(missing_ok=True)
    (home / "gpumesh.db").symlink_to(target)
    db = home / "gpumesh.db"
    _one_line_error(
        gpumesh(home, "peers"),
        CONFIG_EXIT,
        f"{db} is a link: GPUMesh opens no links in its home, a link planted there could "
        f"send its state elsewhere; remove it (`rm {db}`) and run the command again",
    )
    assert target.read_bytes() == b"precious\n"
    assert target.stat().st_mode & 0o777 == 0o644
    assert not (tmp_path / "someone-elses-file-wal").exists()


def test_planted_key_and_config_links_are_refused(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert gpumesh(home, "init", "--name", "alice").returncode == 0
    secret = tmp_path / "elsewhere.toml"
    secret.write_text('node_name = "mallory"\n')
    config = home / "config.toml"
    config.unlink()
    config.symlink_to(secret)
    _one_line_error(gpumesh(home, "peers"), CONFIG_EXIT, f"{config} is a link")
    config.unlink()
    key = home / "identity.key"
    os.replace(key, tmp_path / "moved.key")
    key.symlink_to(tmp_path / "moved.key")
    _one_line_error(
        gpumesh(home, "pair-code"),
        IDENTITY_EXIT,
        f"{key} is a link: GPUMesh opens no links in its home; remove it (`rm {key}`)",
    )
