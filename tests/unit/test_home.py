"""store/home: where a node's files live, initialisation checks, and the agent
running in this process as owner actions reach it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from gpumesh.errors import NotInitializedError
from gpumesh.identity.keys import Identity
from gpumesh.store.home import AgentInfo, Home, RelayState

NO_SUCH_PID = 2**31 - 1


def test_paths_live_under_the_home(tmp_path: Path) -> None:
    home = Home(tmp_path)
    assert home.key_path == tmp_path / "identity.key"
    assert home.config_path == tmp_path / "config.toml"
    assert home.db_path == tmp_path / "gpumesh.db"


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


class _Agent:
    """A stand-in for the agent's side of Home: what it says, what it was told."""

    def __init__(self, info: AgentInfo) -> None:
        self.said = info
        self.told = 0
        self.ended: list[str] = []

    def info(self) -> AgentInfo:
        return self.said

    def changed(self) -> None:
        self.told += 1

    def end_session(self, session_id: str) -> bool:
        self.ended.append(session_id)
        return True


def test_no_agent_runs_until_one_is_attached(tmp_path: Path) -> None:
    home = Home(tmp_path)
    assert home.agent is None
    assert home.agent_info() is None
    assert home.agent_changed() is False  # nobody told: said so


def test_an_attached_agent_is_reached_through_any_home_of_its_folder(tmp_path: Path) -> None:
    info = AgentInfo(pid=os.getpid(), host="0.0.0.0", port=47000, started=12.5)
    agent = _Agent(info)
    Home(tmp_path).attach_agent(agent)
    try:
        other = Home(tmp_path / "." / "")  # another Home object, the same folder
        assert other.agent_info() == info
        assert other.agent_changed() is True
        assert agent.told == 1
        assert Home(tmp_path / "elsewhere").agent is None
    finally:
        Home(tmp_path).detach_agent(agent)
    assert Home(tmp_path).agent is None
    # Nothing of it was written into the home: there is no file to go stale.
    assert list(tmp_path.iterdir()) == []


def test_detaching_an_agent_leaves_a_newer_one_attached(tmp_path: Path) -> None:
    home = Home(tmp_path)
    old = _Agent(AgentInfo(pid=1, host="h", port=1, started=0.0))
    new = _Agent(AgentInfo(pid=2, host="h", port=2, started=1.0))
    home.attach_agent(old)
    home.attach_agent(new)
    home.detach_agent(old)  # the old one stopping late
    try:
        assert home.agent is new
    finally:
        home.detach_agent(new)


@pytest.mark.parametrize(
    ("state", "detail", "text"),
    [
        (RelayState.NONE, "", ""),
        (RelayState.REGISTERING, "", "registering"),
        (RelayState.REGISTERED, "203.0.113.3:4799", "registered as 203.0.113.3:4799"),
        (RelayState.REFUSED, "bad token", "refused: bad token"),
        (RelayState.UNAVAILABLE, "no such host", "unavailable: no such host"),
    ],
)
def test_agent_info_says_the_relay_state_in_words(
    state: RelayState, detail: str, text: str
) -> None:
    info = AgentInfo(os.getpid(), "0.0.0.0", 1, 0.0, "relay:1", state, detail)
    assert info.relay_text == text


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.usefixtures("open_umask")
def test_state_files_are_private_from_their_first_byte(tmp_path: Path, identity: Identity) -> None:
    identity.save(tmp_path / "identity.key")
    home = Home(tmp_path)
    try:
        home.config.set("relay_token", "s3cret")
        home.config.save()
        home.store.save_peer(b"k" * 32, "alice", [], "")  # a write: the -wal and -shm files
        wal, shm = (tmp_path / "gpumesh.db-wal", tmp_path / "gpumesh.db-shm")
        for path in (home.config_path, home.db_path, wal, shm):
            assert _mode(path) == 0o600, path
    finally:
        home.close()


def test_secure_narrows_the_home_and_every_state_file(tmp_path: Path, identity: Identity) -> None:
    root = tmp_path / "node"
    identity.save(root / "identity.key")
    files = ["config.toml", "gpumesh.db", "gpumesh.db-wal", "gpumesh.db-shm"]
    files += ["logs/gpumesh.log", "logs/gpumesh.log.1"]
    (root / "logs").mkdir()
    for name in files:
        (root / name).write_text("")
        (root / name).chmod(0o644)
    (root / "logs").chmod(0o755)
    root.chmod(0o755)
    Home(root).secure()
    assert _mode(root) == 0o700
    assert _mode(root / "logs") == 0o700
    for name in files:
        assert _mode(root / name) == 0o600, name


def test_secure_narrows_paired_peers_address_records(tmp_path: Path, identity: Identity) -> None:
    root = tmp_path / "node"
    identity.save(root / "identity.key")
    folder = root / "peer-addresses"
    folder.mkdir()
    (folder / "some-node-id").write_bytes(b"record")
    (folder / "some-node-id").chmod(0o644)
    folder.chmod(0o755)
    home = Home(root)
    assert (folder, 0o700) in home.private_paths()
    assert (folder / "some-node-id", 0o600) in home.private_paths()
    home.secure()
    assert _mode(folder) == 0o700
    assert _mode(folder / "some-node-id") == 0o600


def test_secure_only_takes_permissions_away(tmp_path: Path, identity: Identity) -> None:
    identity.save(tmp_path / "identity.key")
    (tmp_path / "config.toml").write_text("")
    (tmp_path / "config.toml").chmod(0o400)
    tmp_path.chmod(0o500)
    try:
        Home(tmp_path).secure()
        assert _mode(tmp_path) == 0o500
        assert _mode(tmp_path / "config.toml") == 0o400
    finally:
        tmp_path.chmod(0o700)


def test_secure_leaves_a_folder_without_a_node_alone(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    (tmp_path / "config.toml").write_text("")
    (tmp_path / "config.toml").chmod(0o644)
    Home(tmp_path).secure()
    assert _mode(tmp_path) == 0o755
    assert _mode(tmp_path / "config.toml") == 0o644
