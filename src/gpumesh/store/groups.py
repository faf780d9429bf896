"""The groups this node created or joined, and what it knows of their members."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gpumesh.errors import ConfigError, NotFoundError
from gpumesh.identity.keys import NodeId, node_id_for
from gpumesh.store.tables import Tables

__all__ = ["Group", "GroupMember", "GroupTables", "MemberSource"]


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


_GROUP_SELECT = """
    SELECT g.*, (SELECT count(*) FROM group_members m WHERE m.group_id = g.group_id)
        AS member_count
    FROM groups g
"""


class GroupTables(Tables):
    """The store's methods on groups and their members."""

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
            found = self._db.execute("SELECT 1 FROM groups WHERE group_id = ?", (group_id,))
            if found.fetchone() is None:
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
                name, relay = paired["name"], paired["relay"]
                addresses = list(json.loads(paired["addresses"]))
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
