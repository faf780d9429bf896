"""store/home: where a node's files live, initialisation checks and agent.json."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpumesh.errors import NotInitializedError
from gpumesh.identity.keys import Identity
from gpumesh.store.home import AgentInfo, Home

NO_SUCH_PID = 2**31 - 1


def test_paths_live_under_the_home(tmp_path: Path) -> None:
    home = Home(tmp_path)
    assert home.key_path == tmp_path / "identity.key"
    assert home.config_path == tmp_path / "config.toml"
    assert home.db_path == tmp_path / "gpumesh.db"
    assert home.agent_path == tmp_path / "agent.json"


def test_home_comes_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUMESH_HOME", str(tmp_path / "node"))
    assert Home().path == tmp_path / "node"


def test_uninitialised_home_says_to_run_init(tmp_path: Path) -> None:
    home = Home(tmp_path)
    assert not home.initialized
    with pytest.raises(NotInitializedError, match="gpumesh init"):
        home.require_initialized()
    with pytest.raises(NotInitializedError):
        _ = home.store
    assert not home.db_path.exists()


def test_initialised_home_loads_identity_and_store(tmp_path: Path, identity: Identity) -> None:
    identity.save(tmp_path / "identity.key")
    home = Home(tmp_path)
    try:
        assert home.initialized
        assert home.identity.public_key == identity.public_key
        assert home.store.peers() == []
    finally:
        home.close()


def test_agent_info_round_trips_while_the_process_lives(tmp_path: Path) -> None:
    home = Home(tmp_path)
    info = AgentInfo(pid=os.getpid(), host="0.0.0.0", port=47000, started=12.5)
    home.write_agent_info(info)
    assert home.read_agent_info() == info


def test_agent_info_of_a_dead_process_counts_as_none(tmp_path: Path) -> None:
    home = Home(tmp_path)
    home.write_agent_info(AgentInfo(pid=NO_SUCH_PID, host="0.0.0.0", port=1, started=0.0))
    assert home.read_agent_info() is None


@pytest.mark.parametrize("content", ["", "{", "[]", '{"pid": "x"}', '{"pid": 1}'])
def test_corrupt_agent_info_counts_as_none(tmp_path: Path, content: str) -> None:
    home = Home(tmp_path)
    home.agent_path.write_text(content)
    assert home.read_agent_info() is None


def test_clear_agent_info_only_removes_its_own_or_a_stale_file(tmp_path: Path) -> None:
    home = Home(tmp_path)
    home.write_agent_info(AgentInfo(pid=os.getpid(), host="h", port=1, started=0.0))
    home.clear_agent_info(pid=NO_SUCH_PID)
    assert home.agent_path.exists()
    home.clear_agent_info(pid=os.getpid())
    assert not home.agent_path.exists()
