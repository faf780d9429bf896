"""The peers table (the allowlist) and the pairing codes spent here."""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass

from gpumesh.errors import AmbiguousPeerError, PairingCodeError, UnknownPeerError
from gpumesh.identity.hints import dial_order
from gpumesh.identity.keys import NodeId, node_id_for
from gpumesh.store.tables import Tables

__all__ = ["Peer", "PeerTables"]


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
    """How the last session went: ``lan``, ``direct``, ``direct (hole-punched) ...``,
    ``relayed via ...``."""
    channel_blocked_until: float = 0.0
    """Unix time until which its data channel is not tried (one failed to open)."""
    relays: bool = False
    """Its last Welcome said it relays between peers it has paired and allowed."""

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
            relays=bool(row["relays"]),
        )

    def dial_addresses(self) -> list[str]:
        """Addresses to try, the last one that worked first."""
        return dial_order(self.last_address, self.addresses)


class PeerTables(Tables):
    """The store's methods on peers and spent pairing codes."""

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
        relays: bool | None = None,
        now: float | None = None,
    ) -> None:
        """Record an authenticated exchange (and the address and path that worked, and
        whether the peer relays for its peers)."""
        if path is not None:
            self._execute("UPDATE peers SET last_path = ? WHERE node_id = ?", (path, node_id))
        if relays is not None:
            self._execute("UPDATE peers SET relays = ? WHERE node_id = ?", (relays, node_id))
        if address:
            self._execute(
                "UPDATE peers SET last_seen = ?, last_address = ? WHERE node_id = ?",
                (now or time.time(), address, node_id),
            )
        else:
            self._execute(
                "UPDATE peers SET last_seen = ? WHERE node_id = ?", (now or time.time(), node_id)
            )
