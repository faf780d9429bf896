"""SQLite state of a node: peers and the allowlist (later jobs and groups).

One file in WAL mode, safe for the agent and CLI commands at the same time
(each process has its own connection; writers wait on a busy timeout). The
schema has explicit versions: ``MIGRATIONS[i]`` takes version ``i`` to
``i + 1``, run in one transaction when a connection opens.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gpumesh.errors import AmbiguousPeerError, ConfigError, UnknownPeerError
from gpumesh.identity.keys import NodeId, node_id_for

__all__ = ["SCHEMA_VERSION", "Peer", "Store"]

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
        )

    def dial_addresses(self) -> list[str]:
        """Addresses to try, the last one that worked first."""
        ordered = [self.last_address] if self.last_address else []
        ordered += [a for a in self.addresses if a != self.last_address]
        return ordered


class Store:
    """The node's database. Each method is one short transaction."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            path, timeout=10.0, isolation_level=None, check_same_thread=False
        )
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._migrate()

    def close(self) -> None:
        self._db.close()

    def _migrate(self) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                version = self._db.execute("PRAGMA user_version").fetchone()[0]
                if version > SCHEMA_VERSION:
                    raise ConfigError(
                        f"{self.path} was written by a newer GPUMesh (schema {version}, this "
                        f"one knows {SCHEMA_VERSION}): upgrade GPUMesh"
                    )
                for index in range(version, SCHEMA_VERSION):
                    for statement in MIGRATIONS[index].split(";"):
                        if statement.strip():
                            self._db.execute(statement)
                    self._db.execute(f"PRAGMA user_version = {index + 1}")
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

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
        """Insert or refresh a paired peer (allowed); returns the stored record."""
        node_id = node_id_for(public_key)
        self._execute(
            """
            INSERT INTO peers (node_id, name, public_key, addresses, relay, allowed, paired_at)
            VALUES (?, ?, ?, ?, ?, 1, ?)
            ON CONFLICT(node_id) DO UPDATE SET
                name = excluded.name, addresses = excluded.addresses,
                relay = excluded.relay, allowed = 1
            """,
            (node_id, name, public_key, json.dumps(addresses), relay, now or time.time()),
        )
        return self.peer_by_id(node_id)

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

    def touch_peer(
        self, node_id: str, *, address: str | None = None, now: float | None = None
    ) -> None:
        """Record an authenticated exchange (and the address that worked)."""
        if address:
            self._execute(
                "UPDATE peers SET last_seen = ?, last_address = ? WHERE node_id = ?",
                (now or time.time(), address, node_id),
            )
        else:
            self._execute(
                "UPDATE peers SET last_seen = ? WHERE node_id = ?", (now or time.time(), node_id)
            )
