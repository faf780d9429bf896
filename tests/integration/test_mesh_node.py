"""``gpumesh.Mesh()`` through the home's real node process, without Docker: it
starts the node process when none runs, maps the API's ``{code, message}``
back to the error tree, and gets a new node process when the one it used was
stopped between two calls (a change included, sent once)."""

from __future__ import annotations

from pathlib import Path

import pytest

import gpumesh
from gpumesh.errors import NotFoundError, NotInitializedError, PairingCodeError
from tests.integration.node import cli, status, wait_gone

pytestmark = pytest.mark.usefixtures("gpumesh_processes")


@pytest.fixture
def home(tmp_path: Path) -> Path:
    path = tmp_path / "home"
    assert cli(path, "init", "--name", "mesh-node").returncode == 0
    return path


def test_mesh_starts_the_node_process_and_gets_another_after_a_stop(home: Path) -> None:
    assert status(home)["running"] is False
    with gpumesh.Mesh(home) as mesh:
        assert mesh.status(refresh=False).name == "mesh-node"
        first = status(home)["node"]["pid"]  # Mesh() started it
        assert mesh.peers() == [] and mesh.jobs() == []
        assert cli(home, "daemon", "stop").returncode == 0
        assert wait_gone(first)
        with pytest.raises(PairingCodeError) as bad:
            mesh.pair("gpm1_not-a-code")  # a change, to a node process started anew
        assert bad.value.code == "bad_code" and "\n" not in bad.value.message
        second = status(home)["node"]["pid"]
        assert second != first
        with pytest.raises(NotFoundError) as missing:
            mesh.job("ffffffffffff")
        assert missing.value.code == "not_found"
        assert mesh.groups() == []
        assert status(home)["node"]["pid"] == second


def test_mesh_of_a_home_without_a_node_says_so_and_starts_nothing(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    with pytest.raises(NotInitializedError) as error:
        gpumesh.Mesh(empty, in_process=False).status()
    assert error.value.code == "not_initialized" and "gpumesh init" in error.value.message
    assert not (empty / "node.lock").exists()
