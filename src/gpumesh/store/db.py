"""SQLite state of a node: peers and the allowlist, spent pairing codes, jobs, groups.

One file in WAL mode, safe for the agent and CLI commands at the same time
(each process has its own connection; writers wait on a busy timeout). The
schema has explicit versions: ``MIGRATIONS[i]`` takes version ``i`` to
``i + 1``, run in one transaction when a connection opens. The file and its
``-wal`` and ``-shm`` companions are 0600: jobs carry their environment.

:class:`Store` holds the connection and its one transaction function; the
methods on each group of tables are its parts, each with its records:
:mod:`~gpumesh.store.peers`, :mod:`~gpumesh.store.jobs`,
:mod:`~gpumesh.store.images`, :mod:`~gpumesh.store.groups` and
:mod:`~gpumesh.store.shares`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

from gpumesh.errors import ConfigError
from gpumesh.identity.hints import check_hint
from gpumesh.store.groups import GroupTables
from gpumesh.store.images import ImageTables
from gpumesh.store.jobs import JobTables
from gpumesh.store.modes import create_private, refuse_link
from gpumesh.store.peers import PeerTables
from gpumesh.store.shares import ShareTables

__all__ = ["SCHEMA_VERSION", "Store", "sql_statements"]

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
    # 13 -> 14: the owner paused sharing (`gpumesh pause`) until `gpumesh resume`
    """
    CREATE TABLE owner_pause (
        id        INTEGER PRIMARY KEY CHECK (id = 1),
        since     REAL NOT NULL,
        grace     REAL NOT NULL
    );
    """,
    # 14 -> 15: job outputs: the container path a job's finished files are fetched
    # from; on the submitter, where they go and how far they came; on the provider,
    # the files found ready (a path written again gets a new seq)
    """
    ALTER TABLE jobs ADD COLUMN outputs TEXT NOT NULL DEFAULT '';
    ALTER TABLE jobs ADD COLUMN outputs_to TEXT NOT NULL DEFAULT '';
    ALTER TABLE jobs ADD COLUMN outputs_state TEXT NOT NULL DEFAULT '';
    ALTER TABLE jobs ADD COLUMN outputs_seq INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE jobs ADD COLUMN outputs_files INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE jobs ADD COLUMN outputs_bytes INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE jobs ADD COLUMN outputs_note TEXT NOT NULL DEFAULT '';
    CREATE TABLE job_outputs (
        job_id   TEXT NOT NULL,
        path     TEXT NOT NULL,
        seq      INTEGER NOT NULL,
        size     INTEGER NOT NULL,
        mtime_ns INTEGER NOT NULL,
        mtime    REAL NOT NULL,
        PRIMARY KEY (job_id, path)
    );
    CREATE INDEX job_outputs_seq ON job_outputs(job_id, seq);
    """,
    # 15 -> 16: jobs that move. Submitted: the group it may move within, its moves
    # allowed, when its wait in the queue ends, and its hops so far; both roles:
    # the hop's fencing epoch and the starts made before it
    """
    ALTER TABLE jobs ADD COLUMN job_group TEXT NOT NULL DEFAULT '';
    ALTER TABLE jobs ADD COLUMN max_moves INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE jobs ADD COLUMN queue_wait REAL NOT NULL DEFAULT 0;
    ALTER TABLE jobs ADD COLUMN wait_until REAL NOT NULL DEFAULT 0;
    ALTER TABLE jobs ADD COLUMN epoch INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE jobs ADD COLUMN attempts_before INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE jobs ADD COLUMN hops TEXT NOT NULL DEFAULT '[]';
    """,
    # 16 -> 17: whether a peer relays between the peers it has paired and allowed
    # (its Welcome says so), so this node may go through it
    """
    ALTER TABLE peers ADD COLUMN relays INTEGER NOT NULL DEFAULT 0;
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)


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


class Store(PeerTables, JobTables, ImageTables, GroupTables, ShareTables):
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
        for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "foreign_keys=ON"):
            self._db.execute(f"PRAGMA {pragma}")
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
