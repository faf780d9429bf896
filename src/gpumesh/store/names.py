"""Names of peers, groups and jobs, read for shell completion.

Completion runs on every Tab press and must not get in the user's way: it
opens the node's database read-only (it never creates, migrates or writes
it), waits at most a moment for a writer, and answers with no names at all
when anything stands in the way (no home, no database yet, a store held by
a writer, a schema it does not know). It never raises.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

from gpumesh.protocol.states import JobRole

__all__ = ["NameHint", "group_names", "job_ids", "peer_names"]

# Long enough for a writer's short transaction, short enough not to be felt at a Tab press.
_BUSY_TIMEOUT_S = 0.25
# A shell list longer than this is not read; the newest jobs are the ones wanted.
_JOB_LIMIT = 50


@dataclass(frozen=True)
class NameHint:
    """One name to offer and a short description a shell may show beside it."""

    name: str
    hint: str = ""


def _rows(db_path: Path, sql: str, args: tuple[object, ...] = ()) -> list[sqlite3.Row]:
    if not db_path.is_file():  # mode=ro would not create it, but would fail slowly on some paths
        return []
    try:
        db = sqlite3.connect(
            f"{db_path.resolve().as_uri()}?mode=ro", uri=True, timeout=_BUSY_TIMEOUT_S
        )
    except (sqlite3.Error, OSError, ValueError):
        return []
    try:
        db.row_factory = sqlite3.Row
        return db.execute(sql, args).fetchall()
    except sqlite3.Error:  # locked, not a database, or a schema without this table
        return []
    finally:
        db.close()


def peer_names(db_path: Path) -> list[NameHint]:
    """Paired peers by name; a denied one says so."""
    rows = _rows(db_path, "SELECT name, allowed FROM peers ORDER BY name")
    return [NameHint(str(r["name"]), "" if r["allowed"] else "denied") for r in rows]


def group_names(db_path: Path) -> list[NameHint]:
    """Groups this node created or joined, with their member counts."""
    rows = _rows(
        db_path,
        "SELECT g.name, (SELECT count(*) FROM group_members m WHERE m.group_id = g.group_id)"
        " AS members FROM groups g ORDER BY g.name",
    )
    return [NameHint(str(r["name"]), _members(int(r["members"]))) for r in rows]


def job_ids(db_path: Path, role: JobRole | None = None) -> list[NameHint]:
    """Job ids, newest first: submitted and hosted, or those of one ``role``."""
    sql = "SELECT job_id, role, peer_name, state FROM jobs"
    args: tuple[object, ...] = ()
    if role is not None:
        sql += " WHERE role = ?"
        args = (role,)
    rows = _rows(db_path, sql + " ORDER BY created_at DESC LIMIT ?", (*args, _JOB_LIMIT))
    hints: dict[str, NameHint] = {}
    for r in rows:
        where = "on" if r["role"] == JobRole.SUBMITTED else "for"
        hints.setdefault(
            r["job_id"], NameHint(str(r["job_id"]), f"{r['state']} {where} {r['peer_name']}")
        )
    return list(hints.values())


def _members(count: int) -> str:
    return f"{count} member" + ("" if count == 1 else "s")
