"""store/db: hints stored before codes were checked are dropped when the store opens.

A real SQLite file; the bad rows are written with plain SQL, as an older
version of the code (which took any address a code carried) left them.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path

import pytest

from gpumesh.identity.keys import Identity
from gpumesh.store.db import Store


def _write(path: Path, sql: str, *args: object) -> None:
    raw = sqlite3.connect(path)
    try:
        with raw:
            raw.execute(sql, args)
    finally:
        raw.close()


def test_bad_hints_are_dropped_once_with_one_warning_per_node(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "gpumesh.db"
    store = Store(path)
    alice, carol = Identity.generate(), Identity.generate()
    store.save_peer(alice.public_key, "alice", ["192.0.2.1:1"], "")
    store.save_peer(carol.public_key, "carol", ["192.0.2.3:3"], "relay.example.org")
    store.touch_peer(str(alice.node_id), address="192.0.2.1:1")
    store.close()
    bad = ["<b>:1", "a..b:2", 7, "192.0.2.2:2"]
    _write(
        path,
        "UPDATE peers SET addresses = ?, relay = ?, last_address = ? WHERE name = 'alice'",
        json.dumps(bad),
        "[fe80::1%eth0]:4799",
        "a b:1",
    )

    with caplog.at_level(logging.WARNING, logger="gpumesh.store.db"):
        reopened = Store(path)
    try:
        peer = reopened.find_peer("alice")
        assert (peer.addresses, peer.relay, peer.last_address) == (["192.0.2.2:2"], "", "")
        assert peer.dial_addresses() == ["192.0.2.2:2"]
        untouched = reopened.find_peer("carol")
        assert (untouched.addresses, untouched.relay) == (["192.0.2.3:3"], "relay.example.org")
        (record,) = caplog.records
        assert record.getMessage().startswith(
            "peer alice: dropped '<b>:1', 'a..b:2', '7', '[fe80::1%eth0]:4799' stored for it"
        )
    finally:
        reopened.close()

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpumesh.store.db"):
        Store(path).close()
    assert caplog.records == []  # dropped for good: said once


def test_an_addresses_column_that_is_not_a_json_list_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "gpumesh.db"
    store = Store(path)
    alice = Identity.generate()
    store.save_peer(alice.public_key, "alice", ["192.0.2.1:1"], "")
    store.close()
    _write(path, "UPDATE peers SET addresses = 'not json' WHERE name = 'alice'")
    reopened = Store(path)
    try:
        assert reopened.find_peer("alice").addresses == []
    finally:
        reopened.close()
