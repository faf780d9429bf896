"""The node's home folder and the files in it.

::

    $GPUMESH_HOME/     0700
      identity.key     Ed25519 private key, PEM, mode 0600
      config.toml      settings (see gpumesh.store.config), 0600
      gpumesh.db       SQLite (WAL): peers, allowlist, jobs and groups, 0600 (and -wal, -shm)
      logs/            debug logs of CLI commands and the agent, 0700, files 0600
      jobs/            provider: one folder per hosted job (its unpacked workdir)
      files/           provider: each peer's sandbox (cp, mounts, apps), by node id
      apps/            provider: what each peer's synced apps hold, by node id
      appcache/        consumer: manifests of app folders and of what providers hold

The sub-folders are named once, here (:class:`Home`'s ``*_dir`` properties).

Each writer creates its file with its mode; :meth:`Home.secure`, run at every
start, refuses a home another account owns or may write in and narrows
whatever is found wider. Files in the home are opened without following links
(see :mod:`gpumesh.store.modes`).
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

from gpumesh.errors import NotInitializedError
from gpumesh.identity.keys import Identity
from gpumesh.settings import home_dir
from gpumesh.store.config import Config
from gpumesh.store.db import Store
from gpumesh.store.modes import (
    PRIVATE_DIR,
    PRIVATE_FILE,
    narrow,
)
from gpumesh.store.trust import check_home

__all__ = ["AgentInfo", "Home", "LiveAgent", "RelayState"]


class RelayState(enum.StrEnum):
    """Where a sharing agent's registration with its relay stands."""

    NONE = ""
    """No relay configured."""
    UNAVAILABLE = "unavailable"
    """The relay's address did not resolve: sharing goes on without it."""
    REGISTERING = "registering"
    """Waiting for the relay's answer (at start, or after the relay lost us)."""
    REGISTERED = "registered"
    """The relay accepted us; peers behind NAT reach us through it."""
    REFUSED = "refused"
    """The relay refused the registration (a token, its allowlist); retried slowly."""


@dataclass(frozen=True)
class AgentInfo:
    """What a running provider agent says of itself (:meth:`Home.agent_info`, and
    ``GET /api/v1/share`` from the node process that runs it)."""

    pid: int
    host: str
    port: int
    started: float
    relay: str = ""
    """The relay ``host:port`` the agent registers with, or empty."""
    relay_state: RelayState = RelayState.NONE
    relay_detail: str = ""
    """Registered: the address the relay sees us at; refused or unavailable: why."""
    links: list[dict[str, str]] = field(default_factory=list)
    """Connected peers and their paths: ``{"peer": name, "path": "direct"}``."""
    desktop: list[dict[str, str]] = field(default_factory=list)
    """Open desktop connections: ``{"id": …, "peer": name, "kind": "vnc", "port": "5900",
    "since": unix time}``."""
    shells: list[dict[str, str]] = field(default_factory=list)
    """Open shells: ``{"id": …, "peer": name, "image": …, "container": name, "since": unix
    time}``."""
    cuda: list[dict[str, Any]] = field(default_factory=list)
    """Open CUDA sessions (:class:`gpumesh.client.owner.OwnerSession`'s fields)."""
    reclaimed: dict[str, str] = field(default_factory=dict)
    """GPU index -> the owner's processes using it: GPUs taken back from guests
    (``reclaim_on_gpu_use``) until offered again."""
    relaying: Relaying | None = None
    """What it relays for its peers; None unless ``relay_for_peers`` is on."""

    @property
    def relay_text(self) -> str:
        """``registered as ADDR``, ``registering``, ``refused: WHY``, ``unavailable: WHY``
        (empty without a relay)."""
        state = self.relay_state
        if state is RelayState.REGISTERED:
            return f"registered as {self.relay_detail}"
        if state in (RelayState.REFUSED, RelayState.UNAVAILABLE):
            return f"{state}: {self.relay_detail}"
        return str(state)


@dataclass(frozen=True)
class RelayedSession:
    """A session this node relays between two of its peers."""

    a: str
    """The peer that asked for it (its name)."""
    b: str
    """The peer it reaches."""
    bytes: int
    """Bytes relayed both ways so far."""
    age: float
    """Seconds since it was asked for."""
    state: str
    """``pending`` (asked, not yet accepted) or ``active``."""


@dataclass(frozen=True)
class Relaying:
    """This node relaying for its peers (``relay_for_peers``)."""

    sessions: list[RelayedSession]
    registered: list[str]
    """The peers registered with it now (its other peers reach them through it)."""
    max_sessions: int
    """``relay_for_peers_sessions``."""
    rate: int
    """``relay_for_peers_rate``, in bytes a second."""
    bytes_relayed: int
    """Bytes relayed since sharing started."""
    refusals: dict[str, int]
    """Refusal code -> how many (``relay-full``, ``pair-not-allowed``...)."""


class LiveAgent(Protocol):
    """A provider agent running in this process, as the owner's actions reach it."""

    def info(self) -> AgentInfo | None:
        """What it says of itself now."""
        ...

    def changed(self) -> None:
        """The store changed (a deny, an owner cancel): act on it now."""
        ...

    def end_session(self, session_id: str) -> bool:
        """End one open session (a shell, a desktop connection, a CUDA session);
        False when it has none of that id."""
        ...


_AGENTS: dict[Path, LiveAgent] = {}
"""The agents sharing from this process, by home (at most one each)."""


class Home:
    """Paths and lazily opened state of one node."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = home_dir(path)

    def __repr__(self) -> str:
        return f"Home({str(self.path)!r})"

    @property
    def key_path(self) -> Path:
        return self.path / "identity.key"

    @property
    def config_path(self) -> Path:
        return self.path / "config.toml"

    @property
    def db_path(self) -> Path:
        return self.path / "gpumesh.db"

    @property
    def logs_dir(self) -> Path:
        return self.path / "logs"

    @property
    def jobs_dir(self) -> Path:
        """Provider: ``jobs/JOB_ID``, each hosted job's folder."""
        return self.path / "jobs"

    @property
    def files_dir(self) -> Path:
        """Provider: ``files/NODE_ID``, each peer's sandbox."""
        return self.path / "files"

    @property
    def apps_dir(self) -> Path:
        """Provider: ``apps/NODE_ID``, the index of each peer's synced apps."""
        return self.path / "apps"

    @property
    def appcache_dir(self) -> Path:
        """Consumer: manifests of local app folders and of what each provider holds."""
        return self.path / "appcache"

    @property
    def initialized(self) -> bool:
        return self.key_path.exists()

    def private_paths(self) -> list[tuple[Path, int]]:
        """The home, its logs and peer-addresses folders and its state files, each with the
        widest mode allowed.

        The identity key is not here: `gpumesh doctor` reports a key found readable by
        others instead of quietly narrowing it, since such a key may need replacing.
        """
        peer_addresses = self.path / "peer-addresses"  # paired peers' address records
        # The home may be a link to its user's folder (check_home): that folder is meant.
        paths = [(self.path.resolve(), PRIVATE_DIR), (self.logs_dir, PRIVATE_DIR)]
        paths.append((peer_addresses, PRIVATE_DIR))
        files = [self.config_path, self.db_path]
        files += [self.db_path.with_name(self.db_path.name + s) for s in ("-wal", "-shm")]
        for folder in (self.logs_dir, peer_addresses):
            with contextlib.suppress(OSError):
                files += sorted(p for p in folder.iterdir() if p.is_file())
        return paths + [(path, PRIVATE_FILE) for path in files]

    def secure(self) -> None:
        """Refuse a home that is not safe to use; make it 0700 and its state files 0600,
        narrowing whatever is wider.

        Every start runs it (each command, `gpumesh share`), so a mode widened by a
        copy, an archive tool or by hand does not stay. A home another account owns
        or may write in is refused, node or not: its owner could have planted the
        files we would trust. A folder holding no node is left as it is otherwise:
        a mistyped GPUMESH_HOME must not change someone's folder. Paths that are
        not ours to change are left too (`gpumesh doctor` reports them); links are
        refused, never followed.
        """
        check_home(self.path)
        if not self.initialized:
            return
        for path, mode in self.private_paths():
            with contextlib.suppress(PermissionError):
                narrow(path, mode)

    def require_initialized(self) -> None:
        if not self.initialized:
            raise NotInitializedError(
                f"no GPUMesh node in {self.path}: run `gpumesh init --name NAME` first "
                "(or set GPUMESH_HOME to your node's folder)"
            )

    @cached_property
    def identity(self) -> Identity:
        self.require_initialized()
        return Identity.load(self.key_path)

    @cached_property
    def config(self) -> Config:
        return Config.load(self.config_path)

    @cached_property
    def store(self) -> Store:
        self.require_initialized()
        return Store(self.db_path)

    def reload_config(self) -> Config:
        self.__dict__.pop("config", None)
        return self.config

    # --- the agent running in this process ----------------------------------------------

    def attach_agent(self, agent: LiveAgent) -> None:
        """``agent`` now shares this home from this process (the node process's
        share, or a test's): owner actions of the same process reach it directly."""
        _AGENTS[self.path.resolve()] = agent

    def detach_agent(self, agent: LiveAgent) -> None:
        key = self.path.resolve()
        if _AGENTS.get(key) is agent:
            del _AGENTS[key]

    @property
    def agent(self) -> LiveAgent | None:
        """The agent sharing this home from this process, or None."""
        return _AGENTS.get(self.path.resolve())

    def agent_info(self) -> AgentInfo | None:
        """What the running agent says of itself now, or None when none runs."""
        agent = self.agent
        return None if agent is None else agent.info()

    def agent_changed(self) -> bool:
        """Tell the running agent that the store changed (a deny, a cancel), so it
        acts now; False when none runs."""
        agent = self.agent
        if agent is None:
            return False
        agent.changed()
        return True

    def close(self) -> None:
        store = self.__dict__.pop("store", None)
        if store is not None:
            store.close()
