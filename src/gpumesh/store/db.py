"""SQLite state of a node: peers and the allowlist, spent pairing codes, jobs, groups.

One file in WAL mode, safe for the agent and CLI commands at the same time
(each process has its own connection; writers wait on a busy timeout). The
schema has explicit versions: ``MIGRATIONS[i]`` takes version ``i`` to
``i + 1``, run in one transaction when a connection opens. The file and its
``-wal`` and ``-shm`` companions are 0600: jobs carry their environment.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gpumesh.errors import (
    AmbiguousPeerError,
    ConfigError,
    NotFoundError,
    PairingCodeError,
    UnknownPeerError,
)
from gpumesh.identity.hints import check_hint
from gpumesh.identity.keys import NodeId, node_id_for
from gpumesh.protocol.desktop import DesktopKind
from gpumesh.protocol.messages import JobOutput, JobStatus
from gpumesh.protocol.states import FINAL_STATES, JobRole, JobState
from gpumesh.store.modes import create_private, refuse_link

__all__ = [
    "SCHEMA_VERSION",
    "DesktopShare",
    "Group",
    "GroupMember",
    "JobEvent",
    "JobRecord",
    "MemberSource",
    "Peer",
    "Store",
    "sql_statements",
]

_FINAL = "(" + ", ".join(sorted(f"'{state}'" for state in FINAL_STATES)) + ")"
"""``('cancelled', 'failed', 'succeeded')``: the final job states as an SQL list."""

_JOB_COLUMNS = [
    "role",
    "job_id",
    "peer_id",
    "peer_name",
    "image",
    "command",
    "env",
    "gpu_memory",
    "gpus",
    "retries",
    "timeout",
    "workdir",
    "state",
    "attempt",
    "exit_code",
    "message",
    "cancel_requested",
    "container_id",
    "log_cursor",
    "last_seq",
    "created_at",
    "started_at",
    "finished_at",
    "peak_gpu_memory",
    "output_bytes",
    "output_dropped",
    "confirmed_at",
    "provider_forgot",
    "mounts",
]
_JSON_COLUMNS = {"command", "env", "gpus", "log_cursor", "mounts"}

logger = logging.getLogger(__name__)

# Migrations are history: each keeps the literal values (roles, states) it was
# written with, whatever the code calls them now.
MIGRATIONS: list[str] = [
    # 0 -> 1: peers and the allowlist
    """
    CREATE TABLE peers (
        node_id      TEXT PRIMARY KEY,
        name         TEXT NOT NULL,
        public_key   BLOB NOT NULL UNIQUE,
        addresses    TEXT NOT NULL DEFAULT '[]',
        relay        TEXT NOT NULL DEFAULT '',
        allowed      INTEGER NOT NULL DEFAULT 1,
        paired_at    REAL NOT NULL,
        last_seen    REAL,
        last_address TEXT NOT NULL DEFAULT ''
    );
    CREATE INDEX peers_name ON peers(name);
    """,
    # 1 -> 2: jobs (hosted here or submitted from here) and their event logs
    """
    CREATE TABLE jobs (
        role         TEXT NOT NULL CHECK (role IN ('hosted', 'submitted')),
        job_id       TEXT NOT NULL,
        peer_id      TEXT NOT NULL,
        peer_name    TEXT NOT NULL,
        image        TEXT NOT NULL,
        command      TEXT NOT NULL DEFAULT '[]',
        env          TEXT NOT NULL DEFAULT '{}',
        gpu_memory   INTEGER NOT NULL DEFAULT 0,
        gpus         TEXT NOT NULL DEFAULT '[]',
        retries      INTEGER NOT NULL DEFAULT 0,
        timeout      REAL NOT NULL DEFAULT 0,
        workdir      TEXT NOT NULL DEFAULT '',
        state        TEXT NOT NULL,
        attempt      INTEGER NOT NULL DEFAULT 0,
        exit_code    INTEGER,
        message      TEXT NOT NULL DEFAULT '',
        cancel_requested INTEGER NOT NULL DEFAULT 0,
        container_id TEXT NOT NULL DEFAULT '',
        log_cursor   TEXT NOT NULL DEFAULT '{}',
        last_seq     INTEGER NOT NULL DEFAULT 0,
        created_at   REAL NOT NULL,
        started_at   REAL,
        finished_at  REAL,
        PRIMARY KEY (role, job_id)
    );
    CREATE INDEX jobs_created ON jobs(created_at);
    CREATE TABLE job_events (
        job_id   TEXT NOT NULL,
        seq      INTEGER NOT NULL,
        ts       REAL NOT NULL,
        attempt  INTEGER NOT NULL,
        kind     TEXT NOT NULL CHECK (kind IN ('stdout', 'stderr', 'state')),
        data     BLOB NOT NULL,
        PRIMARY KEY (job_id, seq)
    );
    """,
    # 2 -> 3: groups this node created or joined, and what it knows of their members
    """
    CREATE TABLE groups (
        group_id   TEXT PRIMARY KEY,
        name       TEXT NOT NULL UNIQUE,
        created_at REAL NOT NULL,
        joined_via TEXT NOT NULL DEFAULT ''
    );
    CREATE TABLE group_members (
        group_id   TEXT NOT NULL REFERENCES groups(group_id) ON DELETE CASCADE,
        node_id    TEXT NOT NULL,
        name       TEXT NOT NULL,
        public_key BLOB NOT NULL,
        addresses  TEXT NOT NULL DEFAULT '[]',
        relay      TEXT NOT NULL DEFAULT '',
        added_at   REAL NOT NULL,
        PRIMARY KEY (group_id, node_id)
    );
    """,
    # 3 -> 4: measured peak GPU memory of each job
    """
    ALTER TABLE jobs ADD COLUMN peak_gpu_memory INTEGER NOT NULL DEFAULT 0;
    """,
    # 4 -> 5: the path (direct, hole-punched, relayed) the last session with a peer took
    """
    ALTER TABLE peers ADD COLUMN last_path TEXT NOT NULL DEFAULT '';
    """,
    # 5 -> 6: pairing codes already used here (a code pairs once), kept until they expire
    """
    CREATE TABLE used_codes (
        nonce    BLOB PRIMARY KEY,
        node_id  TEXT NOT NULL,
        used_at  REAL NOT NULL,
        expires  REAL NOT NULL
    );
    CREATE INDEX used_codes_expires ON used_codes(expires);
    """,
    # 6 -> 7: where each piece of output lies in its job's output, and what was
    # dropped to keep a job's stored output within job_log_limit
    """
    ALTER TABLE job_events ADD COLUMN position INTEGER NOT NULL DEFAULT -1;
    ALTER TABLE jobs ADD COLUMN output_bytes INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE jobs ADD COLUMN output_dropped INTEGER NOT NULL DEFAULT 0;
    UPDATE jobs SET output_bytes = (
        SELECT COALESCE(SUM(length(data)), 0) FROM job_events e
        WHERE e.job_id = jobs.job_id AND e.kind != 'state'
    ) WHERE role = 'hosted';
    """,
    # 7 -> 8: images this node pulled for peers' jobs (the ones image_disk may prune)
    """
    CREATE TABLE pulled_images (
        image     TEXT PRIMARY KEY,
        size      INTEGER NOT NULL,
        pulled_at REAL NOT NULL,
        last_used REAL NOT NULL
    );
    """,
    # 8 -> 9: until when a peer's data channel is known not to open (a firewall drops
    # its TCP port): copies go straight to QUIC until then
    """
    ALTER TABLE peers ADD COLUMN channel_blocked_until REAL NOT NULL DEFAULT 0;
    """,
    # 9 -> 10: submitted jobs: when their provider last confirmed their state, and
    # whether it said it no longer knows them
    """
    ALTER TABLE jobs ADD COLUMN confirmed_at REAL;
    ALTER TABLE jobs ADD COLUMN provider_forgot INTEGER NOT NULL DEFAULT 0;
    UPDATE jobs SET confirmed_at = created_at WHERE role = 'submitted';
    """,
    # 10 -> 11: sandbox folders mounted into each job
    """
    ALTER TABLE jobs ADD COLUMN mounts TEXT NOT NULL DEFAULT '[]';
    """,
    # 11 -> 12: the desktop allowlist (its own, empty until the owner adds a peer) and
    # the desktop share (the one local port peers on it may reach)
    """
    CREATE TABLE desktop_allowed (
        node_id    TEXT PRIMARY KEY REFERENCES peers(node_id) ON DELETE CASCADE,
        allowed_at REAL NOT NULL
    );
    CREATE TABLE desktop_share (
        id        INTEGER PRIMARY KEY CHECK (id = 1),
        kind      TEXT NOT NULL,
        port      INTEGER NOT NULL,
        shared_at REAL NOT NULL
    );
    """,
    # 12 -> 13: CUDA remoting: its own allowlist (empty by default) and whether this
    # node offers CUDA sessions when it shares
    """
    CREATE TABLE cuda_allowed (
        node_id    TEXT PRIMARY KEY REFERENCES peers(node_id) ON DELETE CASCADE,
        allowed_at REAL NOT NULL
    );
    CREATE TABLE cuda_share (
        id         INTEGER PRIMARY KEY CHECK (id = 1),
        sharing    INTEGER NOT NULL,
        changed_at REAL NOT NULL
    );
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)


@dataclass(frozen=True)
class Peer:
    """A paired node as this node knows it."""

    node_id: NodeId
    name: str
    public_key: bytes
    addresses: list[str]
    """``host:port`` hints from its pairing code."""
    relay: str
    allowed: bool
    """Whether this node serves the peer (default-deny: only paired peers exist)."""
    paired_at: float
    last_seen: float | None
    """Unix time of the last authenticated exchange in either direction."""
    last_address: str
    """The ``host:port`` that last worked, tried first."""
    last_path: str = ""
    """How the last session went: ``direct``, ``direct (hole-punched) ...``, ``relayed via ...``."""
    channel_blocked_until: float = 0.0
    """Unix time until which its data channel is not tried (one failed to open)."""

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> Peer:
        return cls(
            node_id=NodeId(row["node_id"]),
            name=row["name"],
            public_key=bytes(row["public_key"]),
            addresses=list(json.loads(row["addresses"])),
            relay=row["relay"],
            allowed=bool(row["allowed"]),
            paired_at=row["paired_at"],
            last_seen=row["last_seen"],
            last_address=row["last_address"],
            last_path=row["last_path"],
            channel_blocked_until=row["channel_blocked_until"],
        )

    def dial_addresses(self) -> list[str]:
        """Addresses to try, the last one that worked first."""
        ordered = [self.last_address] if self.last_address else []
        ordered += [a for a in self.addresses if a != self.last_address]
        return ordered


@dataclass(frozen=True)
class JobRecord:
    """A job as this node knows it: ``hosted`` (ran here) or ``submitted`` (sent to a peer)."""

    role: JobRole
    job_id: str
    peer_id: str
    """The submitter (hosted) or the provider (submitted)."""
    peer_name: str
    image: str
    command: list[str]
    env: dict[str, str]
    gpu_memory: int
    gpus: list[str]
    retries: int
    timeout: float
    workdir: str
    """Hosted: the unpacked workdir on this machine; submitted: the local folder sent."""
    created_at: float
    state: JobState = JobState.QUEUED
    attempt: int = 0
    exit_code: int | None = None
    message: str = ""
    cancel_requested: bool = False
    container_id: str = ""
    log_cursor: dict[str, list[object]] = field(default_factory=dict)
    """Hosted: per stream, where the engine's log was read up to."""
    last_seq: int = 0
    """Hosted: last event written; submitted: last event received."""
    started_at: float | None = None
    finished_at: float | None = None
    peak_gpu_memory: int = 0
    """Most GPU memory the job's processes used at once (sampled while running)."""
    output_bytes: int = 0
    """Hosted: bytes of output (stdout and stderr, every attempt) written so far,
    which is where the next piece of output starts."""
    output_dropped: int = 0
    """Bytes of the oldest output dropped to keep what is stored within the
    provider's ``job_log_limit``. Hosted: exactly; submitted: as far as this node
    has been told (the drop is always a prefix of the output, so a gap that ends at
    offset N says that N bytes were dropped)."""
    confirmed_at: float | None = None
    """Submitted: when the provider last told this node the job's state (its
    acceptance, an event, or an answer to a refresh)."""
    provider_forgot: bool = False
    """Submitted: the provider answered that it no longer knows the job (pruned
    there, or its home was reset): its state here is the last one known."""
    mounts: list[dict[str, Any]] = field(default_factory=list)
    """Sandbox folders mounted into the job. Hosted: each ``{"remote": "/datasets",
    "source": its host path, "target": "/data", "rw": bool}``; submitted: each
    ``{"source": "/datasets", "target": "/data", "rw": bool}``."""

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> JobRecord:
        values = {name: row[name] for name in _JOB_COLUMNS}
        for name in _JSON_COLUMNS:
            values[name] = json.loads(values[name])
        values["cancel_requested"] = bool(values["cancel_requested"])
        values["provider_forgot"] = bool(values["provider_forgot"])
        values["role"] = JobRole(values["role"])
        values["state"] = JobState(values["state"])
        return cls(**values)

    @property
    def duration(self) -> float | None:
        if self.started_at is None:
            return None
        end = self.finished_at if self.finished_at is not None else time.time()
        return max(0.0, end - self.started_at)


@dataclass(frozen=True)
class JobEvent:
    job_id: str
    seq: int
    ts: float
    attempt: int
    kind: str
    """``stdout``, ``stderr`` or ``state`` (data: JSON of state, exit_code, message)."""
    data: bytes
    position: int = -1
    """Output: where ``data`` starts in the job's output (stdout and stderr together,
    every attempt); -1 for state events and output stored before positions were kept."""

    def to_message(self) -> JobOutput | JobStatus:
        """The wire message that carries this event to a follower."""
        if self.kind != "state":
            return JobOutput(
                seq=self.seq,
                attempt=self.attempt,
                stream=self.kind,
                data=self.data,
                offset=self.position,
            )
        info = json.loads(self.data)
        return JobStatus(
            job_id=self.job_id,
            seq=self.seq,
            state=info["state"],
            attempt=self.attempt,
            exit_code=info["exit_code"],
            message=info["message"],
            peak_gpu_memory=info.get("peak_gpu_memory", 0),
            time=self.ts,
            exited=info.get("exited"),
        )


@dataclass(frozen=True)
class Group:
    """A group this node created or joined."""

    group_id: str
    name: str
    """Unique on this node: commands address groups by name."""
    created_at: float
    """When this node created or joined the group."""
    joined_via: str
    """Node id of the member whose invite this node joined with; empty if created here."""
    member_count: int

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> Group:
        return cls(
            group_id=row["group_id"],
            name=row["name"],
            created_at=row["created_at"],
            joined_via=row["joined_via"],
            member_count=row["member_count"],
        )

    @property
    def short_id(self) -> str:
        return self.group_id[:12]


@dataclass(frozen=True)
class GroupMember:
    """A member of a group as this node knows it (from an invite, `group add` or itself)."""

    group_id: str
    node_id: NodeId
    name: str
    public_key: bytes
    addresses: list[str]
    relay: str
    added_at: float

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> GroupMember:
        return cls(
            group_id=row["group_id"],
            node_id=NodeId(row["node_id"]),
            name=row["name"],
            public_key=bytes(row["public_key"]),
            addresses=list(json.loads(row["addresses"])),
            relay=row["relay"],
            added_at=row["added_at"],
        )


class MemberSource(Protocol):
    """What a member is saved from: a :class:`Peer`, an invite's member, or this node."""

    @property
    def name(self) -> str: ...
    @property
    def public_key(self) -> bytes: ...
    @property
    def addresses(self) -> list[str]: ...
    @property
    def relay(self) -> str: ...


@dataclass(frozen=True)
class DesktopShare:
    """The desktop this node's owner shares: peers on the desktop allowlist reach
    exactly this local port, nothing else."""

    kind: DesktopKind
    port: int
    """The TCP port on 127.0.0.1 the provider forwards to."""
    shared_at: float


_GROUP_SELECT = """
    SELECT g.*, (SELECT count(*) FROM group_members m WHERE m.group_id = g.group_id)
        AS member_count
    FROM groups g
"""


def sql_statements(script: str) -> Iterator[str]:
    """The statements of ``script``, in order, each ending at the ``;`` that SQLite
    itself takes for its end (not one inside a literal, a comment or a trigger's
    body): a migration step runs statement by statement inside the one
    transaction that also reads and sets the schema version, which
    ``executescript`` (it commits first) cannot do."""
    pending = ""
    for piece in script.rstrip().split(";"):
        pending += piece + ";"
        if sqlite3.complete_statement(pending):
            if pending.strip(" \t\r\n;"):
                yield pending
            pending = ""
    if pending.strip(" \t\r\n;"):
        raise ValueError(f"unfinished SQL statement: {pending.strip()[:80]!r}")


class Store:
    """The node's database. Each method is one short transaction."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        # SQLite gives the -wal and -shm files the database's mode: make it 0600 first
        # (never by opening it: that would drop the locks of this process's other
        # connections to it, see create_private).
        create_private(path)
        # SQLite follows links: none may stand for the database or its journals.
        for journal in ("-wal", "-shm"):
            refuse_link(path.with_name(path.name + journal))
        self._db = sqlite3.connect(
            path, timeout=10.0, isolation_level=None, check_same_thread=False
        )
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._migrate()
        self._drop_bad_hints()

    def close(self) -> None:
        self._db.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """Hold the connection for one ``BEGIN IMMEDIATE`` transaction: committed when
        the block ends, rolled back when anything leaves it (an error, a cancel).

        IMMEDIATE takes the write lock at the start, so two processes never both
        read and then fail to write; the busy timeout makes the second one wait.
        """
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _migrate(self) -> None:
        with self._transaction():
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise ConfigError(
                    f"{self.path} was written by a newer GPUMesh (schema {version}, this "
                    f"one knows {SCHEMA_VERSION}): upgrade GPUMesh"
                )
            for index in range(version, SCHEMA_VERSION):
                for statement in sql_statements(MIGRATIONS[index]):
                    self._db.execute(statement)
                self._db.execute(f"PRAGMA user_version = {index + 1}")

    def _drop_bad_hints(self) -> None:
        """Forget the addresses and relays of peers and group members that are not
        ``host:port`` (:func:`~gpumesh.identity.hints.check_hint`), with one warning
        per node. Codes and invites are checked so since; a node paired before kept
        what its code said, and a dial must never meet it."""
        fixes: list[tuple[str, int, str, list[str], str, list[str]]] = []
        for table in ("peers", "group_members"):
            for row in self._query(f"SELECT rowid, name, addresses, relay FROM {table}"):
                kept, relay, dropped = _good_hints(row["addresses"], row["relay"])
                if dropped:
                    fixes.append((table, row["rowid"], row["name"], kept, relay, dropped))
        stale = [
            row["rowid"]
            for row in self._query("SELECT rowid, last_address FROM peers")
            if row["last_address"] and not _is_hint(row["last_address"])
        ]
        if not fixes and not stale:
            return
        with self._transaction():
            for table, rowid, _name, kept, relay, _dropped in fixes:
                self._db.execute(
                    f"UPDATE {table} SET addresses = ?, relay = ? WHERE rowid = ?",
                    (json.dumps(kept), relay, rowid),
                )
            for rowid in stale:
                self._db.execute("UPDATE peers SET last_address = '' WHERE rowid = ?", (rowid,))
        for table, _rowid, name, _kept, _relay, dropped in fixes:
            logger.warning(
                "%s %s: dropped %s stored for it (not host:port; from a code or invite of "
                "before they were checked): pair again with a fresh code if it is not reached",
                "peer" if table == "peers" else "group member",
                name,
                ", ".join(repr(text[:60]) for text in dropped),
            )

    @property
    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def _query(self, sql: str, args: tuple[object, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _execute(self, sql: str, args: tuple[object, ...] = ()) -> int:
        with self._lock:
            return self._db.execute(sql, args).rowcount

    # --- peers --------------------------------------------------------------------

    def save_peer(
        self,
        public_key: bytes,
        name: str,
        addresses: list[str],
        relay: str,
        *,
        now: float | None = None,
    ) -> Peer:
        """Insert a peer (allowed) or refresh a known key's name, addresses and relay.

        A refresh keeps the peer's allowed flag: only `allow` lifts a denial.
        """
        node_id = node_id_for(public_key)
        with self._lock:
            self._upsert_peer(public_key, name, addresses, relay, True, now or time.time())
        return self.peer_by_id(node_id)

    def pair_peer(
        self,
        public_key: bytes,
        name: str,
        addresses: list[str],
        relay: str,
        *,
        nonce: bytes,
        expires: float,
        replaces: str | None = None,
        now: float | None = None,
    ) -> Peer:
        """Store a peer from its pairing code and spend the code, in one transaction.

        ``nonce`` and ``expires`` are the code's: a nonce already spent here
        (and not yet expired) is refused, so a code pairs once. ``replaces`` is
        the node id of a peer to drop first (the same name with the key it had
        before a reinstall). A known key is refreshed and keeps its allowed
        flag; a new key is allowed unless the peer it replaces was denied.
        Spent codes past their expiry are pruned here: they could not verify.
        """
        now = now or time.time()
        node_id = node_id_for(public_key)
        with self._transaction():
            self._db.execute("DELETE FROM used_codes WHERE expires < ?", (now,))
            spent = self._db.execute(
                "SELECT 1 FROM used_codes WHERE nonce = ?", (nonce,)
            ).fetchone()
            if spent is not None:
                raise PairingCodeError(
                    f"that pairing code of {name} was already used on this node, and a "
                    f"code pairs once; ask {name} for a fresh code (`gpumesh pair-code` "
                    "on their side)"
                )
            allowed = True
            if replaces is not None and replaces != node_id:
                old = self._db.execute(
                    "SELECT allowed FROM peers WHERE node_id = ?", (replaces,)
                ).fetchone()
                # A reinstall does not lift a denial of the name it takes over.
                allowed = old is None or bool(old["allowed"])
                self._db.execute("DELETE FROM peers WHERE node_id = ?", (replaces,))
            self._upsert_peer(public_key, name, addresses, relay, allowed, now)
            self._db.execute(
                "INSERT INTO used_codes (nonce, node_id, used_at, expires) VALUES (?, ?, ?, ?)",
                (nonce, node_id, now, expires),
            )
        return self.peer_by_id(node_id)

    def _upsert_peer(
        self,
        public_key: bytes,
        name: str,
        addresses: list[str],
        relay: str,
        allowed: bool,
        now: float,
    ) -> None:
        # Caller holds the lock. ``allowed`` applies to a new row only: a known
        # key keeps its flag, so refreshing a denied peer never re-allows it.
        self._db.execute(
            """
            INSERT INTO peers (node_id, name, public_key, addresses, relay, allowed, paired_at)
            VALUES (?, ?, ?, ?, ?, ?, ?)
            ON CONFLICT(node_id) DO UPDATE SET
                name = excluded.name, addresses = excluded.addresses, relay = excluded.relay
            """,
            (
                node_id_for(public_key),
                name,
                public_key,
                json.dumps(addresses),
                relay,
                int(allowed),
                now,
            ),
        )

    def delete_peer(self, node_id: str) -> None:
        self._execute("DELETE FROM peers WHERE node_id = ?", (node_id,))

    def peer_by_id(self, node_id: str) -> Peer:
        rows = self._query("SELECT * FROM peers WHERE node_id = ?", (node_id,))
        if not rows:
            raise UnknownPeerError(f"no paired peer with id {node_id}")
        return Peer.from_row(rows[0])

    def peer_by_key(self, public_key: bytes) -> Peer | None:
        rows = self._query("SELECT * FROM peers WHERE public_key = ?", (public_key,))
        return Peer.from_row(rows[0]) if rows else None

    def peer_by_name(self, name: str) -> Peer | None:
        rows = self._query("SELECT * FROM peers WHERE name = ?", (name,))
        return Peer.from_row(rows[0]) if len(rows) == 1 else None

    def peers(self) -> list[Peer]:
        return [Peer.from_row(r) for r in self._query("SELECT * FROM peers ORDER BY name, node_id")]

    def find_peer(self, query: str) -> Peer:
        """A peer by exact name, or by unambiguous id prefix (4+ characters)."""
        query = query.strip()
        by_name = self._query("SELECT * FROM peers WHERE name = ?", (query,))
        if len(by_name) == 1:
            return Peer.from_row(by_name[0])
        if len(by_name) > 1:
            ids = ", ".join(r["node_id"][:12] for r in by_name)
            raise AmbiguousPeerError(
                f"{len(by_name)} peers are named {query!r} ({ids}): use an id prefix instead"
            )
        prefix = query.lower()
        matches = []
        if len(prefix) >= 4:
            matches = self._query(
                "SELECT * FROM peers WHERE substr(node_id, 1, ?) = ?", (len(prefix), prefix)
            )
        if len(matches) == 1:
            return Peer.from_row(matches[0])
        if len(matches) > 1:
            names = ", ".join(f"{r['name']} ({r['node_id'][:12]})" for r in matches)
            raise AmbiguousPeerError(
                f"id prefix {query!r} matches {len(matches)} peers: {names}; type more of the id"
            )
        raise UnknownPeerError(
            f"no paired peer named {query!r}: see `gpumesh peers`, or pair it first with "
            "`gpumesh pair '<code>'`"
        )

    def set_allowed(self, node_id: str, allowed: bool) -> None:
        self._execute("UPDATE peers SET allowed = ? WHERE node_id = ?", (int(allowed), node_id))

    def allowed_keys(self, keys: list[bytes]) -> set[bytes]:
        """Which of ``keys`` belong to allowed peers (one query for many links)."""
        if not keys:
            return set()
        marks = ",".join("?" * len(keys))
        rows = self._query(
            f"SELECT public_key FROM peers WHERE allowed = 1 AND public_key IN ({marks})",
            tuple(keys),
        )
        return {bytes(r["public_key"]) for r in rows}

    def block_channel(self, node_id: str, until: float) -> None:
        """Remember that the peer's data channel does not open, until ``until``
        (0: forget it)."""
        self._execute(
            "UPDATE peers SET channel_blocked_until = ? WHERE node_id = ?", (until, node_id)
        )

    def touch_peer(
        self,
        node_id: str,
        *,
        address: str | None = None,
        path: str | None = None,
        now: float | None = None,
    ) -> None:
        """Record an authenticated exchange (and the address and path that worked)."""
        if path is not None:
            self._execute("UPDATE peers SET last_path = ? WHERE node_id = ?", (path, node_id))
        if address:
            self._execute(
                "UPDATE peers SET last_seen = ?, last_address = ? WHERE node_id = ?",
                (now or time.time(), address, node_id),
            )
        else:
            self._execute(
                "UPDATE peers SET last_seen = ? WHERE node_id = ?", (now or time.time(), node_id)
            )

    # --- jobs ---------------------------------------------------------------------

    def add_job(self, job: JobRecord) -> None:
        values = [getattr(job, name) for name in _JOB_COLUMNS]
        values = [
            json.dumps(v) if name in _JSON_COLUMNS else v
            for name, v in zip(_JOB_COLUMNS, values, strict=True)
        ]
        marks = ",".join("?" * len(_JOB_COLUMNS))
        self._execute(
            f"INSERT INTO jobs ({','.join(_JOB_COLUMNS)}) VALUES ({marks})", tuple(values)
        )

    def update_job(self, role: JobRole, job_id: str, **fields: object) -> None:
        if not fields:
            return
        unknown = set(fields) - set(_JOB_COLUMNS)
        if unknown:
            raise ValueError(f"unknown job fields: {sorted(unknown)}")
        sets = ", ".join(f"{name} = ?" for name in fields)
        values = [json.dumps(v) if k in _JSON_COLUMNS else v for k, v in fields.items()]
        self._execute(
            f"UPDATE jobs SET {sets} WHERE role = ? AND job_id = ?", (*values, role, job_id)
        )

    def delete_job(self, role: JobRole, job_id: str) -> None:
        with self._transaction():
            self._db.execute("DELETE FROM jobs WHERE role = ? AND job_id = ?", (role, job_id))
            if role == JobRole.HOSTED:
                self._db.execute("DELETE FROM job_events WHERE job_id = ?", (job_id,))

    def job(self, role: JobRole, job_id: str) -> JobRecord | None:
        rows = self._query("SELECT * FROM jobs WHERE role = ? AND job_id = ?", (role, job_id))
        return JobRecord.from_row(rows[0]) if rows else None

    def find_job(self, query: str, role: JobRole | None = None) -> JobRecord:
        """A job by id or unambiguous id prefix (4+ characters), newest first."""
        query = query.strip().lower()
        if len(query) < 4:
            raise NotFoundError(f"job id {query!r} is too short: type at least 4 characters")
        sql = "SELECT * FROM jobs WHERE substr(job_id, 1, ?) = ?"
        args: tuple[object, ...] = (len(query), query)
        if role is not None:
            sql += " AND role = ?"
            args += (role,)
        rows = self._query(sql + " ORDER BY created_at DESC", args)
        if not rows:
            raise NotFoundError(f"no job {query!r} here: see `gpumesh jobs`")
        ids = {r["job_id"] for r in rows}
        if len(ids) > 1:
            raise NotFoundError(
                f"job id prefix {query!r} matches {len(ids)} jobs: type more of the id"
            )
        return JobRecord.from_row(rows[0])

    def jobs(self, limit: int = 20, role: JobRole | None = None) -> list[JobRecord]:
        if role is None:
            rows = self._query("SELECT * FROM jobs ORDER BY created_at DESC LIMIT ?", (limit,))
        else:
            rows = self._query(
                "SELECT * FROM jobs WHERE role = ? ORDER BY created_at DESC LIMIT ?",
                (role, limit),
            )
        return [JobRecord.from_row(r) for r in rows]

    def unconfirmed_submitted_jobs(self, limit: int = 1000) -> list[JobRecord]:
        """Of the ``limit`` newest jobs, the submitted ones not known to have ended
        (and that their providers have not forgotten): those worth asking about."""
        rows = self._query(
            "SELECT * FROM (SELECT * FROM jobs ORDER BY created_at DESC LIMIT ?) "
            f"WHERE role = ? AND provider_forgot = 0 AND state NOT IN {_FINAL} "
            "ORDER BY created_at DESC",
            (limit, JobRole.SUBMITTED),
        )
        return [JobRecord.from_row(r) for r in rows]

    def finished_jobs_before(self, cutoff: float) -> list[JobRecord]:
        rows = self._query(
            f"SELECT * FROM jobs WHERE (state IN {_FINAL} "
            "OR provider_forgot = 1) AND created_at < ? ORDER BY created_at",
            (cutoff,),
        )
        return [JobRecord.from_row(r) for r in rows]

    # --- images pulled for peers ---------------------------------------------------

    def record_pulled_image(self, image: str, size: int, now: float | None = None) -> None:
        stamp = time.time() if now is None else now
        self._execute(
            "INSERT INTO pulled_images (image, size, pulled_at, last_used) VALUES (?, ?, ?, ?) "
            "ON CONFLICT(image) DO UPDATE SET size = excluded.size, last_used = excluded.last_used",
            (image, size, stamp, stamp),
        )

    def touch_pulled_image(self, image: str, now: float | None = None) -> None:
        stamp = time.time() if now is None else now
        self._execute("UPDATE pulled_images SET last_used = ? WHERE image = ?", (stamp, image))

    def pulled_images(self) -> list[tuple[str, int, float]]:
        """(image, size, last used) of the images pulled for peers, least recently used first."""
        rows = self._query("SELECT image, size, last_used FROM pulled_images ORDER BY last_used")
        return [(str(r["image"]), int(r["size"]), float(r["last_used"])) for r in rows]

    def forget_pulled_image(self, image: str) -> None:
        self._execute("DELETE FROM pulled_images WHERE image = ?", (image,))

    def hosted_workdirs(self, peer_id: str) -> list[str]:
        """The folders the peer's hosted jobs worked in (their files may still be there)."""
        rows = self._query(
            "SELECT workdir FROM jobs WHERE role = ? AND peer_id = ? AND workdir != ''",
            (JobRole.HOSTED, peer_id),
        )
        return [str(row["workdir"]) for row in rows]

    def unfinished_hosted_jobs(self) -> list[JobRecord]:
        rows = self._query(
            f"SELECT * FROM jobs WHERE role = ? AND state NOT IN {_FINAL} ORDER BY created_at",
            (JobRole.HOSTED,),
        )
        return [JobRecord.from_row(r) for r in rows]

    def append_job_event(
        self,
        job_id: str,
        attempt: int,
        kind: str,
        data: bytes,
        *,
        log_cursor: dict[str, list[object]] | None = None,
        log_limit: int = 0,
        now: float | None = None,
    ) -> int:
        """Append one event to a hosted job's log; returns its sequence number.

        See :meth:`append_job_events`.
        """
        return self.append_job_events(
            job_id, attempt, [(kind, data)], log_cursor=log_cursor, log_limit=log_limit, now=now
        )

    def append_job_events(
        self,
        job_id: str,
        attempt: int,
        events: Sequence[tuple[str, bytes]],
        *,
        log_cursor: dict[str, list[object]] | None = None,
        log_limit: int = 0,
        now: float | None = None,
    ) -> int:
        """Append ``(kind, data)`` events to a hosted job's log in one transaction;
        returns the last sequence number.

        The engine-log cursor moves in the same transaction, so after a crash
        the log is resumed exactly where the stored events end. Output events
        (``stdout``/``stderr``) get their position in the job's output. With
        ``log_limit``, the oldest output is then deleted until what is kept is
        at most that many bytes (state events are kept: a job has few), and
        ``output_dropped`` counts it; a reader learns of the gap from the
        positions, so each is told exactly what it missed.
        """
        when = now or time.time()
        with self._transaction():
            row = self._db.execute(
                "SELECT last_seq, output_bytes, output_dropped FROM jobs "
                "WHERE role = ? AND job_id = ?",
                (JobRole.HOSTED, job_id),
            ).fetchone()
            seq, written, dropped = int(row[0]), int(row[1]), int(row[2])
            for kind, data in events:
                seq += 1
                position = -1
                if kind != "state":
                    position, written = written, written + len(data)
                self._db.execute(
                    "INSERT INTO job_events (job_id, seq, ts, attempt, kind, data, position) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (job_id, seq, when, attempt, kind, data, position),
                )
            if log_limit and written - dropped > log_limit:
                dropped += self._drop_oldest_output(job_id, written - dropped - log_limit)
            self._db.execute(
                "UPDATE jobs SET last_seq = ?, output_bytes = ?, output_dropped = ? "
                "WHERE role = ? AND job_id = ?",
                (seq, written, dropped, JobRole.HOSTED, job_id),
            )
            if log_cursor is not None:
                self._db.execute(
                    "UPDATE jobs SET log_cursor = ? WHERE role = ? AND job_id = ?",
                    (json.dumps(log_cursor), JobRole.HOSTED, job_id),
                )
        return seq

    def _drop_oldest_output(self, job_id: str, excess: int) -> int:
        """Delete the oldest output events of a job, at least ``excess`` bytes of them;
        returns how many bytes went (inside the caller's transaction)."""
        freed, last = 0, 0
        rows = self._db.execute(
            "SELECT seq, length(data) FROM job_events "
            "WHERE job_id = ? AND kind != 'state' ORDER BY seq",
            (job_id,),
        )
        for seq, size in rows:
            freed, last = freed + int(size), int(seq)
            if freed >= excess:
                break
        rows.close()
        self._db.execute(
            "DELETE FROM job_events WHERE job_id = ? AND kind != 'state' AND seq <= ?",
            (job_id, last),
        )
        return freed

    def job_events(self, job_id: str, after_seq: int = 0, limit: int = 1000) -> list[JobEvent]:
        rows = self._query(
            "SELECT * FROM job_events WHERE job_id = ? AND seq > ? ORDER BY seq LIMIT ?",
            (job_id, after_seq, limit),
        )
        return [
            JobEvent(
                r["job_id"],
                r["seq"],
                r["ts"],
                r["attempt"],
                r["kind"],
                bytes(r["data"]),
                r["position"],
            )
            for r in rows
        ]

    # --- groups -------------------------------------------------------------------

    def add_group(
        self,
        group_id: str,
        name: str,
        members: Sequence[MemberSource],
        *,
        joined_via: str = "",
        now: float | None = None,
    ) -> Group:
        """Record a new group with its first members, in one transaction.

        Group names are unique on a node (commands take names), so a second
        group of one name is refused, as is a group id already recorded.
        Members are saved as :meth:`save_group_members` saves them.
        """
        now = now or time.time()
        with self._transaction():
            taken = self._db.execute(
                "SELECT group_id, name FROM groups WHERE name = ? OR group_id = ?",
                (name, group_id),
            ).fetchone()
            if taken is not None and taken["name"] == name:
                raise ConfigError(
                    f"a group named {name!r} already exists on this node "
                    f"({taken['group_id'][:12]}): see `gpumesh group list`"
                )
            if taken is not None:
                raise ConfigError(
                    f"group {group_id[:12]} is already on this node as {taken['name']!r}"
                )
            self._db.execute(
                "INSERT INTO groups (group_id, name, created_at, joined_via) VALUES (?, ?, ?, ?)",
                (group_id, name, now, joined_via),
            )
            self._upsert_members(group_id, members, now)
        return self.group_by_id(group_id)

    def save_group_members(
        self, group_id: str, members: Sequence[MemberSource], *, now: float | None = None
    ) -> None:
        """Add members to a recorded group, or refresh their name, addresses and relay.

        A member whose key is a paired peer is saved with the name, addresses
        and relay of its pairing, whatever ``members`` says (see
        :meth:`_upsert_members`).
        """
        with self._transaction():
            if (
                self._db.execute("SELECT 1 FROM groups WHERE group_id = ?", (group_id,)).fetchone()
                is None
            ):
                raise NotFoundError(f"no group with id {group_id} on this node")
            self._upsert_members(group_id, members, now or time.time())

    def _upsert_members(self, group_id: str, members: Sequence[MemberSource], now: float) -> None:
        # Caller holds the lock and a transaction; added_at keeps the first sighting.
        for member in members:
            name, addresses, relay = member.name, list(member.addresses), member.relay
            paired = self._db.execute(
                "SELECT name, addresses, relay FROM peers WHERE public_key = ?",
                (member.public_key,),
            ).fetchone()
            if paired is not None:
                # This node's own pairing is the source of truth for a peer it
                # paired: an invite (anyone's) only fills in members it has not.
                name, addresses, relay = (
                    paired["name"],
                    list(json.loads(paired["addresses"])),
                    paired["relay"],
                )
            self._db.execute(
                """
                INSERT INTO group_members
                    (group_id, node_id, name, public_key, addresses, relay, added_at)
                VALUES (?, ?, ?, ?, ?, ?, ?)
                ON CONFLICT(group_id, node_id) DO UPDATE SET
                    name = excluded.name, addresses = excluded.addresses,
                    relay = excluded.relay
                """,
                (
                    group_id,
                    node_id_for(member.public_key),
                    name,
                    member.public_key,
                    json.dumps(addresses),
                    relay,
                    now,
                ),
            )

    def group_by_id(self, group_id: str) -> Group:
        rows = self._query(_GROUP_SELECT + " WHERE g.group_id = ?", (group_id,))
        if not rows:
            raise NotFoundError(f"no group with id {group_id} on this node")
        return Group.from_row(rows[0])

    def group_by_name(self, name: str) -> Group | None:
        rows = self._query(_GROUP_SELECT + " WHERE g.name = ?", (name,))
        return Group.from_row(rows[0]) if rows else None

    def groups(self) -> list[Group]:
        return [Group.from_row(r) for r in self._query(_GROUP_SELECT + " ORDER BY g.name")]

    def find_group(self, query: str) -> Group:
        """A group by exact name, or by unambiguous id prefix (4+ characters)."""
        query = query.strip()
        by_name = self.group_by_name(query)
        if by_name is not None:
            return by_name
        prefix = query.lower()
        matches = []
        if len(prefix) >= 4:
            matches = self._query(
                _GROUP_SELECT + " WHERE substr(g.group_id, 1, ?) = ?", (len(prefix), prefix)
            )
        if len(matches) == 1:
            return Group.from_row(matches[0])
        if len(matches) > 1:
            names = ", ".join(r["name"] for r in matches)
            raise NotFoundError(
                f"group id prefix {query!r} matches {len(matches)} groups ({names}): "
                "use the group's name"
            )
        raise NotFoundError(
            f"no group named {query!r} on this node: see `gpumesh group list`, create it with "
            f"`gpumesh group create NAME`, or join it with `gpumesh group join '<invite>'`"
        )

    def group_members(self, group_id: str) -> list[GroupMember]:
        rows = self._query(
            "SELECT * FROM group_members WHERE group_id = ? ORDER BY name, node_id", (group_id,)
        )
        return [GroupMember.from_row(r) for r in rows]

    # --- the desktop share and its allowlist -----------------------------------------

    def desktop_share(self) -> DesktopShare | None:
        """The desktop the owner shares, or None (not shared)."""
        rows = self._query("SELECT kind, port, shared_at FROM desktop_share WHERE id = 1")
        if not rows:
            return None
        row = rows[0]
        return DesktopShare(DesktopKind.parse(row["kind"]), int(row["port"]), row["shared_at"])

    def set_desktop_share(
        self, kind: DesktopKind, port: int, now: float | None = None
    ) -> DesktopShare:
        when = now or time.time()
        self._execute(
            "INSERT INTO desktop_share (id, kind, port, shared_at) VALUES (1, ?, ?, ?) "
            "ON CONFLICT(id) DO UPDATE SET kind = excluded.kind, port = excluded.port, "
            "shared_at = excluded.shared_at",
            (str(kind), port, when),
        )
        return DesktopShare(kind, port, when)

    def clear_desktop_share(self) -> bool:
        """Stop sharing the desktop; False when it was not shared."""
        return self._execute("DELETE FROM desktop_share WHERE id = 1") > 0

    def set_desktop_allowed(self, node_id: str, allowed: bool, now: float | None = None) -> None:
        if allowed:
            self._execute(
                "INSERT OR IGNORE INTO desktop_allowed (node_id, allowed_at) VALUES (?, ?)",
                (node_id, now or time.time()),
            )
        else:
            self._execute("DELETE FROM desktop_allowed WHERE node_id = ?", (node_id,))

    def desktop_allowed_ids(self) -> set[str]:
        """Peers that may use the desktop: on its allowlist and not denied altogether."""
        rows = self._query(
            "SELECT d.node_id FROM desktop_allowed d JOIN peers p ON p.node_id = d.node_id "
            "WHERE p.allowed = 1"
        )
        return {str(r["node_id"]) for r in rows}

    # --- CUDA remoting: its allowlist and whether it is shared ------------------------

    def cuda_allow(self, node_id: str, now: float | None = None) -> None:
        """Let a paired peer open CUDA sessions here (besides the peer allowlist)."""
        self._execute(
            "INSERT OR IGNORE INTO cuda_allowed (node_id, allowed_at) VALUES (?, ?)",
            (node_id, time.time() if now is None else now),
        )

    def cuda_deny(self, node_id: str) -> bool:
        """Take a peer off the CUDA allowlist; False when it was not on it."""
        return self._execute("DELETE FROM cuda_allowed WHERE node_id = ?", (node_id,)) > 0

    def cuda_allowed(self) -> set[str]:
        """The node ids on the CUDA allowlist."""
        return {r["node_id"] for r in self._query("SELECT node_id FROM cuda_allowed")}

    def set_cuda_share(self, sharing: bool, now: float | None = None) -> None:
        """Remember whether this node offers CUDA sessions whenever it shares."""
        self._execute(
            "INSERT INTO cuda_share (id, sharing, changed_at) VALUES (1, ?, ?) "
            "ON CONFLICT (id) DO UPDATE SET sharing = excluded.sharing, "
            "changed_at = excluded.changed_at",
            (int(sharing), time.time() if now is None else now),
        )

    def cuda_share(self) -> bool:
        """Whether this node offers CUDA sessions (off until `cuda share`)."""
        rows = self._query("SELECT sharing FROM cuda_share WHERE id = 1")
        return bool(rows and rows[0]["sharing"])


def _is_hint(text: object, *, port_optional: bool = False) -> bool:
    if not isinstance(text, str):
        return False
    try:
        check_hint(text, port_optional=port_optional)
    except ValueError:
        return False
    return True


def _good_hints(addresses_json: str, relay: str) -> tuple[list[str], str, list[str]]:
    """A stored row's addresses and relay with only the good hints kept, and the
    texts dropped (anything not a string, or not JSON at all, as it reads)."""
    try:
        addresses = json.loads(addresses_json)
    except ValueError:
        addresses = [addresses_json]
    if not isinstance(addresses, list):
        addresses = [addresses]
    kept = [a for a in addresses if _is_hint(a)]
    dropped = [a if isinstance(a, str) else repr(a) for a in addresses if not _is_hint(a)]
    if relay and not _is_hint(relay, port_optional=True):
        dropped.append(relay)
        relay = ""
    return kept, relay, dropped
