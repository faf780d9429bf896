"""store/db: schema migrations, peers by name and id prefix, allowlist, spent codes, WAL."""

from __future__ import annotations

import hashlib
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpumesh.errors import AmbiguousPeerError, ConfigError, PairingCodeError, UnknownPeerError
from gpumesh.identity.keys import node_id_for
from gpumesh.protocol.states import FINAL_STATES, JobRole, JobState
from gpumesh.store.db import MIGRATIONS, SCHEMA_VERSION, Store, sql_statements
from gpumesh.store.jobs import JobRecord
from gpumesh.store.peers import Peer


def key(n: int) -> bytes:
    return hashlib.sha256(b"peer-key-%d" % n).digest()


def two_keys_sharing_an_id_prefix(length: int = 4) -> tuple[bytes, bytes]:
    seen: dict[str, bytes] = {}
    for n in range(100_000):
        prefix = node_id_for(key(n))[:length]
        if prefix in seen:
            return seen[prefix], key(n)
        seen[prefix] = key(n)
    raise AssertionError("no collision found")


# --- schema -------------------------------------------------------------------


def test_new_database_is_at_the_current_schema(store: Store) -> None:
    assert SCHEMA_VERSION >= 1
    assert store.schema_version == SCHEMA_VERSION


def test_reopening_keeps_data_and_does_not_migrate_again(tmp_path: Path) -> None:
    path = tmp_path / "gpumesh.db"
    first = Store(path)
    first.save_peer(key(1), "alice", [], "")
    first.close()
    # Re-running the 0 -> 1 migration would fail: its CREATE TABLE has no IF NOT EXISTS.
    second = Store(path)
    try:
        assert second.schema_version == SCHEMA_VERSION
        assert [p.name for p in second.peers()] == ["alice"]
    finally:
        second.close()


def test_a_database_from_a_newer_gpumesh_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "gpumesh.db"
    raw = sqlite3.connect(path)
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    raw.close()
    with pytest.raises(ConfigError, match="newer GPUMesh"):
        Store(path)


def _posix_locks_held_on(path: Path) -> int:
    """POSIX locks this process holds on ``path``'s inode, from the kernel's table."""
    inode = f":{path.stat().st_ino}"
    held = 0
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if fields[1] == "POSIX" and fields[4] == str(os.getpid()) and fields[5].endswith(inode):
            held += 1
    return held


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="reads Linux's /proc/locks")
def test_a_second_store_leaves_the_first_ones_locks_alone(tmp_path: Path) -> None:
    # Closing any descriptor of a file drops every POSIX lock the process holds on
    # it: a Store that opened the database file itself to set its mode took the
    # locks of the agent's connection in the same process, and SQLite then served
    # the agent a stale snapshot (a denied peer still let in).
    path = tmp_path / "gpumesh.db"
    first = Store(path)
    held = _posix_locks_held_on(path)
    assert held >= 1  # SQLite holds its shared lock on an open WAL database
    second = Store(path)
    assert _posix_locks_held_on(path) >= held
    second.close()
    first.close()


def test_an_existing_database_is_narrowed_to_the_owner(tmp_path: Path) -> None:
    path = tmp_path / "gpumesh.db"
    Store(path).close()
    path.chmod(0o644)
    Store(path).close()
    assert path.stat().st_mode & 0o777 == 0o600


def test_wal_mode_is_on(store: Store) -> None:
    raw = sqlite3.connect(store.path)
    try:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        raw.close()


def test_two_stores_on_one_file_see_each_others_writes(tmp_path: Path) -> None:
    path = tmp_path / "gpumesh.db"
    agent, cli = Store(path), Store(path)
    try:
        peer = cli.save_peer(key(1), "alice", ["192.0.2.1:47000"], "")
        assert agent.find_peer("alice").node_id == peer.node_id
        agent.set_allowed(peer.node_id, False)
        assert not cli.find_peer("alice").allowed
        agent.delete_peer(peer.node_id)
        assert cli.peers() == []
    finally:
        agent.close()
        cli.close()


# --- peers --------------------------------------------------------------------


def test_save_peer_stores_everything(store: Store) -> None:
    peer = store.save_peer(key(1), "alice", ["192.0.2.1:47000", "10.0.0.2:47000"], "r:1", now=50.0)
    assert peer.node_id == node_id_for(key(1))
    assert peer.name == "alice"
    assert peer.public_key == key(1)
    assert peer.addresses == ["192.0.2.1:47000", "10.0.0.2:47000"]
    assert peer.relay == "r:1"
    assert peer.allowed
    assert peer.paired_at == 50.0
    assert peer.last_seen is None
    assert peer.last_address == ""
    assert store.peer_by_key(key(1)) == peer
    assert store.peer_by_id(peer.node_id) == peer


def test_saving_again_refreshes_but_keeps_a_denial(store: Store) -> None:
    first = store.save_peer(key(1), "alice", ["a:1"], "", now=50.0)
    store.set_allowed(first.node_id, False)
    again = store.save_peer(key(1), "alice2", ["b:2"], "r:3", now=99.0)
    assert again.name == "alice2"
    assert again.addresses == ["b:2"]
    assert again.relay == "r:3"
    assert not again.allowed  # only `allow` lifts a denial
    assert again.paired_at == 50.0
    assert len(store.peers()) == 1
    store.set_allowed(first.node_id, True)
    assert store.save_peer(key(1), "alice2", [], "").allowed


# --- pairing codes pair once --------------------------------------------------

NONCE = b"n" * 16


def _pair(store: Store, n: int, name: str, *addresses: str, **kwargs: object) -> Peer:
    options: dict[str, Any] = {
        "relay": "",
        "nonce": NONCE,
        "expires": 1000.0,
        "now": 100.0,
        **kwargs,
    }
    return store.pair_peer(key(n), name, list(addresses), **options)


def _spent(store: Store) -> list[tuple[bytes, str, float]]:
    raw = sqlite3.connect(store.path)  # another connection, as another process would see it
    try:
        rows = raw.execute("SELECT nonce, node_id, expires FROM used_codes ORDER BY nonce")
        return [(bytes(nonce), node_id, expires) for nonce, node_id, expires in rows]
    finally:
        raw.close()


def test_migration_6_adds_spent_codes_and_keeps_existing_data(tmp_path: Path) -> None:
    path = tmp_path / "gpumesh.db"
    raw = sqlite3.connect(path)
    for index in range(5):  # a version-5 database, as the previous release left it
        raw.executescript(MIGRATIONS[index])
        raw.execute(f"PRAGMA user_version = {index + 1}")
    raw.execute(
        "INSERT INTO peers (node_id, name, public_key, allowed, paired_at) VALUES (?, ?, ?, 0, ?)",
        (node_id_for(key(1)), "alice", key(1), 50.0),
    )
    raw.commit()
    raw.close()
    store = Store(path)
    try:
        assert store.schema_version == SCHEMA_VERSION >= 6
        (alice,) = store.peers()
        assert (alice.name, alice.allowed) == ("alice", False)
        assert _spent(store) == []
        _pair(store, 2, "bob")
        assert _spent(store) == [(NONCE, node_id_for(key(2)), 1000.0)]
    finally:
        store.close()


def test_a_pairing_code_pairs_once(store: Store) -> None:
    peer = _pair(store, 1, "alice", "a:1")
    assert peer.allowed
    assert _spent(store) == [(NONCE, peer.node_id, 1000.0)]
    store.set_allowed(peer.node_id, False)
    with pytest.raises(PairingCodeError, match="already used on this node") as info:
        _pair(store, 1, "alice", "b:2", now=200.0)
    assert "ask alice for a fresh code (`gpumesh pair-code` on their side)" in str(info.value)
    # Refused whole: neither the addresses nor the denial changed.
    assert store.peer_by_id(peer.node_id).addresses == ["a:1"]
    assert not store.peer_by_id(peer.node_id).allowed
    assert len(_spent(store)) == 1
    # Another code of the same peer pairs (and refreshes) as usual.
    assert _pair(store, 1, "alice", "c:3", nonce=b"m" * 16).addresses == ["c:3"]


def test_a_spent_code_is_forgotten_once_it_expires(store: Store) -> None:
    _pair(store, 1, "alice", expires=1000.0, now=100.0)
    _pair(store, 2, "bob", nonce=b"m" * 16, expires=1500.0, now=999.0)
    assert [n for n, _, _ in _spent(store)] == [b"m" * 16, NONCE]  # not expired yet
    # Written after alice's code expired: her row goes, bob's stays.
    _pair(store, 3, "carol", nonce=b"o" * 16, expires=2000.0, now=1000.5)
    assert [n for n, _, _ in _spent(store)] == [b"m" * 16, b"o" * 16]


def test_a_denied_peers_fresh_code_refreshes_its_hints_and_keeps_it_denied(store: Store) -> None:
    peer = _pair(store, 1, "alice", "a:1")
    store.set_allowed(peer.node_id, False)
    again = _pair(store, 1, "alice", "b:2", nonce=b"m" * 16, relay="r:1")
    assert again.addresses == ["b:2"]
    assert again.relay == "r:1"
    assert not again.allowed
    assert store.allowed_keys([key(1)]) == set()


def test_a_new_key_replacing_a_denied_one_stays_denied(store: Store) -> None:
    old = _pair(store, 1, "alice", "a:1")
    store.set_allowed(old.node_id, False)
    new = _pair(store, 2, "alice", "b:2", nonce=b"m" * 16, replaces=old.node_id)
    assert [p.node_id for p in store.peers()] == [new.node_id]
    assert not new.allowed
    assert new.addresses == ["b:2"]


def test_a_new_key_replacing_an_allowed_one_is_allowed(store: Store) -> None:
    old = _pair(store, 1, "alice", "a:1")
    new = _pair(store, 2, "alice", "b:2", nonce=b"m" * 16, replaces=old.node_id)
    assert [(p.node_id, p.allowed) for p in store.peers()] == [(new.node_id, True)]


def test_a_refused_reuse_replaces_nothing(store: Store) -> None:
    old = _pair(store, 1, "alice", "a:1", nonce=b"m" * 16)
    _pair(store, 2, "bob")
    with pytest.raises(PairingCodeError, match="already used"):
        _pair(store, 2, "alice", replaces=old.node_id)
    assert sorted(p.name for p in store.peers()) == ["alice", "bob"]


def test_find_peer_by_exact_name(store: Store) -> None:
    store.save_peer(key(1), "alice", [], "")
    bob = store.save_peer(key(2), "bob", [], "")
    assert store.find_peer("bob") == bob
    assert store.find_peer("  bob\n") == bob


@pytest.mark.parametrize("length", [4, 5, 12, 26])
def test_find_peer_by_id_prefix(store: Store, length: int) -> None:
    alice = store.save_peer(key(1), "alice", [], "")
    store.save_peer(key(2), "bob", [], "")
    assert store.find_peer(alice.node_id[:length]) == alice
    assert store.find_peer(alice.node_id[:length].upper()) == alice


def test_an_id_prefix_shorter_than_4_is_not_used(store: Store) -> None:
    alice = store.save_peer(key(1), "alice", [], "")
    with pytest.raises(UnknownPeerError):
        store.find_peer(alice.node_id[:3])


def test_unknown_peer_message_says_what_to_do(store: Store) -> None:
    store.save_peer(key(1), "alice", [], "")
    with pytest.raises(UnknownPeerError) as info:
        store.find_peer("carol")
    message = str(info.value)
    assert "'carol'" in message
    assert "gpumesh peers" in message
    assert "gpumesh pair" in message


def test_ambiguous_id_prefix_lists_the_candidates(store: Store) -> None:
    first, second = two_keys_sharing_an_id_prefix()
    a = store.save_peer(first, "alice", [], "")
    b = store.save_peer(second, "bob", [], "")
    prefix = a.node_id[:4]
    assert b.node_id[:4] == prefix
    with pytest.raises(AmbiguousPeerError) as info:
        store.find_peer(prefix)
    message = str(info.value)
    assert "matches 2 peers" in message
    assert "alice" in message
    assert "bob" in message
    # A longer prefix that tells them apart works.
    common = next(i for i in range(26) if a.node_id[i] != b.node_id[i])
    assert store.find_peer(a.node_id[: common + 1]) == a


def test_two_peers_with_one_name_are_ambiguous_by_name(store: Store) -> None:
    a = store.save_peer(key(1), "gpu", [], "")
    b = store.save_peer(key(2), "gpu", [], "")
    with pytest.raises(AmbiguousPeerError, match="2 peers are named 'gpu'") as info:
        store.find_peer("gpu")
    assert a.node_id[:12] in str(info.value)
    assert b.node_id[:12] in str(info.value)
    assert store.peer_by_name("gpu") is None
    assert store.find_peer(a.node_id) == a


def test_a_name_wins_over_an_id_prefix(store: Store) -> None:
    alice = store.save_peer(key(1), "alice", [], "")
    named_like_id = store.save_peer(key(2), alice.node_id[:6], [], "")
    assert store.find_peer(alice.node_id[:6]) == named_like_id


def test_peer_by_id_unknown(store: Store) -> None:
    with pytest.raises(UnknownPeerError):
        store.peer_by_id(node_id_for(key(9)))
    assert store.peer_by_key(key(9)) is None


def test_peers_are_listed_by_name(store: Store) -> None:
    for n, name in enumerate(["carol", "alice", "bob"]):
        store.save_peer(key(n), name, [], "")
    assert [p.name for p in store.peers()] == ["alice", "bob", "carol"]


# --- allowlist ----------------------------------------------------------------


def test_allowed_keys_follows_set_allowed(store: Store) -> None:
    a = store.save_peer(key(1), "alice", [], "")
    store.save_peer(key(2), "bob", [], "")
    assert store.allowed_keys([key(1), key(2), key(3)]) == {key(1), key(2)}
    store.set_allowed(a.node_id, False)
    assert store.allowed_keys([key(1), key(2)]) == {key(2)}
    assert store.find_peer("alice").allowed is False
    store.set_allowed(a.node_id, True)
    assert store.allowed_keys([key(1)]) == {key(1)}


def test_allowed_keys_of_nothing(store: Store) -> None:
    store.save_peer(key(1), "alice", [], "")
    assert store.allowed_keys([]) == set()


# --- last seen ----------------------------------------------------------------


def test_touch_peer_records_time_and_address(store: Store) -> None:
    peer = store.save_peer(key(1), "alice", ["a:1", "b:2", "c:3"], "")
    store.touch_peer(peer.node_id, address="b:2", now=123.0)
    touched = store.peer_by_id(peer.node_id)
    assert touched.last_seen == 123.0
    assert touched.last_address == "b:2"
    assert touched.dial_addresses() == ["b:2", "a:1", "c:3"]


def test_touch_without_address_keeps_the_last_address(store: Store) -> None:
    peer = store.save_peer(key(1), "alice", ["a:1"], "")
    store.touch_peer(peer.node_id, address="a:1", now=1.0)
    store.touch_peer(peer.node_id, now=2.0)
    touched = store.peer_by_id(peer.node_id)
    assert touched.last_seen == 2.0
    assert touched.last_address == "a:1"


def test_dial_addresses_without_a_last_address_keeps_the_order(store: Store) -> None:
    peer = store.save_peer(key(1), "alice", ["a:1", "b:2"], "")
    assert peer.dial_addresses() == ["a:1", "b:2"]


def test_dial_addresses_includes_a_last_address_not_in_the_code(store: Store) -> None:
    peer = store.save_peer(key(1), "alice", ["a:1"], "")
    store.touch_peer(peer.node_id, address="nat:9", now=1.0)
    assert store.peer_by_id(peer.node_id).dial_addresses() == ["nat:9", "a:1"]


# --- transactions and job states ---------------------------------------------


@dataclass(frozen=True)
class _Member:
    name: str
    public_key: bytes
    relay: str = ""

    @property
    def addresses(self) -> list[str]:
        if self.name == "broken":
            raise RuntimeError("interrupted in the middle of the transaction")
        return []


def test_a_transaction_that_fails_half_way_leaves_nothing_and_the_store_goes_on(
    tmp_path: Path,
) -> None:
    path = tmp_path / "gpumesh.db"
    store = Store(path)
    try:
        # The group row and the first member are written before the second one fails.
        members = [_Member("alice", key(1)), _Member("broken", key(2))]
        with pytest.raises(RuntimeError, match="interrupted"):
            store.add_group("g" * 64, "research", members)
        assert store.groups() == []
        # Rolled back, not left open: the next transaction (and another process) can write.
        store.add_group("h" * 64, "research", [_Member("alice", key(1))])
        other = Store(path)
        try:
            other.save_peer(key(3), "carol", [], "")
        finally:
            other.close()
        assert [g.name for g in store.groups()] == ["research"]
        assert [p.name for p in store.peers()] == ["carol"]
    finally:
        store.close()


def _job(role: JobRole, job_id: str, state: JobState, created_at: float) -> JobRecord:
    return JobRecord(
        role=role,
        job_id=job_id,
        peer_id="peer",
        peer_name="bob",
        image="busybox",
        command=["true"],
        env={},
        gpu_memory=0,
        gpus=[],
        retries=0,
        timeout=0.0,
        workdir="",
        created_at=created_at,
        state=state,
    )


def test_every_final_state_counts_as_finished_and_no_other(store: Store) -> None:
    for index, state in enumerate(JobState):
        for role in JobRole:
            store.add_job(_job(role, f"{role}-{state}", state, created_at=float(index)))
    live = sorted(set(JobState) - FINAL_STATES)
    hosted = sorted(j.state for j in store.unfinished_hosted_jobs())
    assert hosted == live
    assert all(j.role == JobRole.HOSTED for j in store.unfinished_hosted_jobs())
    submitted = sorted(j.state for j in store.unconfirmed_submitted_jobs())
    assert submitted == live
    assert all(j.role == JobRole.SUBMITTED for j in store.unconfirmed_submitted_jobs())
    finished = [(j.role, j.state) for j in store.finished_jobs_before(cutoff=100.0)]
    assert sorted(finished) == sorted((r, s) for s in FINAL_STATES for r in JobRole)


# --- migrations are run statement by statement, as SQLite splits them ------------------------

_TRIGGER_STEP = """
CREATE TABLE audit (what TEXT NOT NULL);
-- a comment; with a semicolon
CREATE TRIGGER peers_named AFTER INSERT ON peers BEGIN
    INSERT INTO audit (what) VALUES ('paired; ' || NEW.name);
    INSERT INTO audit (what) VALUES ('second;statement');
END;
INSERT INTO audit (what) VALUES ('made; by the step')
"""


def test_sql_statements_end_where_sqlite_ends_them() -> None:
    found = [" ".join(s.split()) for s in sql_statements(_TRIGGER_STEP)]
    assert found == [
        "CREATE TABLE audit (what TEXT NOT NULL);",
        "-- a comment; with a semicolon CREATE TRIGGER peers_named AFTER INSERT ON peers BEGIN "
        "INSERT INTO audit (what) VALUES ('paired; ' || NEW.name); "
        "INSERT INTO audit (what) VALUES ('second;statement'); END;",
        "INSERT INTO audit (what) VALUES ('made; by the step');",
    ]
    with pytest.raises(ValueError, match="unfinished SQL statement"):
        list(sql_statements("CREATE TRIGGER t AFTER INSERT ON peers BEGIN SELECT 1;"))


def test_a_migration_step_with_a_trigger_and_semicolons_in_literals_runs_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpumesh.store import db

    monkeypatch.setattr(db, "MIGRATIONS", [*MIGRATIONS, _TRIGGER_STEP])
    monkeypatch.setattr(db, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    store = Store(tmp_path / "gpumesh.db")
    try:
        assert store.schema_version == SCHEMA_VERSION + 1
        _pair(store, 2, "bob")
        rows = store._db.execute("SELECT what FROM audit ORDER BY rowid").fetchall()
        assert [row[0] for row in rows] == ["made; by the step", "paired; bob", "second;statement"]
    finally:
        store.close()
