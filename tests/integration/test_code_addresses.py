"""Hostile address hints in codes, invites and the store, through the real CLI.

A pairing code or invite is signed by its node's own key, so the node that
makes one may put anything in its addresses and relay. Each must be refused
in one line before anything is stored; a peer stored before hints were
checked loses the bad ones (one warning) when the store is opened; and no
parser of a resolver or of the QUIC stack may turn a hint into a crash of
`pair`, `connect` or `run --group`.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from gpumesh.identity.codes import make_code
from gpumesh.identity.invites import InviteMember, make_invite, new_group_id
from gpumesh.identity.keys import Identity
from tests.integration.conftest import gpumesh
from tests.integration.node import cli, status
from tests.integration.test_cli import _free_udp_port, _init, _one_line_error, _start_share

pytestmark = pytest.mark.usefixtures("gpumesh_processes")

# Each raised out of the dial before hints were checked: the first two from the
# resolver's IDNA codec (a label empty or over 63 characters), the last from
# socket.connect's lookup of markup.
ESCAPING = ["a..b:47000", "x" * 64 + ".example:47000", "<b>x</b>:47000"]


def _set_hints(home: Path, table: str, name: str, addresses: list[str], relay: str) -> None:
    """Write hints straight into the store, as a node paired before they were checked has."""
    raw = sqlite3.connect(home / "gpumesh.db")
    try:
        with raw:
            changed = raw.execute(
                f"UPDATE {table} SET addresses = ?, relay = ? WHERE name = ?",
                (json.dumps(addresses), relay, name),
            ).rowcount
        assert changed >= 1
    finally:
        raw.close()


def _stored(home: Path, table: str, name: str) -> tuple[list[str], str]:
    raw = sqlite3.connect(home / "gpumesh.db")
    try:
        (addresses, relay), *_ = raw.execute(
            f"SELECT addresses, relay FROM {table} WHERE name = ?", (name,)
        ).fetchall()
        return json.loads(addresses), str(relay)
    finally:
        raw.close()


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


@pytest.fixture
def bob(tmp_path: Path) -> Path:
    home = tmp_path / "b"
    _init(home, "bob")
    return home


@pytest.mark.parametrize("hint", ESCAPING)
@pytest.mark.parametrize("field", ["address", "relay"])
def test_pair_refuses_a_code_with_a_bad_hint_and_stores_nothing(
    bob: Path, hint: str, field: str
) -> None:
    good = ["127.0.0.1:9"]
    addresses, relay = ([*good, hint], "") if field == "address" else (good, hint)
    code = make_code(Identity.generate(), "alice", addresses, relay)
    refused = gpumesh(bob, "pair", code)
    _one_line_error(refused, 2, f"that pairing code carries a bad {field}: ")
    assert "ask the peer for a fresh `gpumesh pair-code`" in refused.stderr
    assert json.loads(gpumesh(bob, "peers", "--json").stdout) == []


def test_group_join_refuses_an_invite_with_a_bad_hint_and_stores_nothing(bob: Path) -> None:
    inviter = Identity.generate()
    invite = make_invite(
        inviter,
        new_group_id(),
        "research",
        [InviteMember("alice", inviter.public_key, ["127.0.0.1:9", ESCAPING[0]], "")],
    )
    refused = gpumesh(bob, "group", "join", invite)
    _one_line_error(refused, 2, "that group invite carries a bad address for alice: 'a..b:47000'")
    assert json.loads(gpumesh(bob, "group", "list", "--json").stdout) == []


def test_a_stored_bad_hint_is_dropped_with_one_warning(bob: Path, tmp_path: Path) -> None:
    alice = tmp_path / "a"
    _init(alice, "alice", 47311)
    assert gpumesh(bob, "pair", "--offline", gpumesh(alice, "pair-code").stdout).returncode == 0
    # The store as an older version left it: written while no node process holds it.
    assert gpumesh(bob, "daemon", "stop").returncode == 0
    _set_hints(bob, "peers", "alice", [*ESCAPING, "127.0.0.1:47311"], "r..x:4799")

    first = gpumesh(bob, "peers", "--json")
    assert first.returncode == 0, first.stderr
    (peer,) = json.loads(first.stdout)
    assert peer["addresses"] == ["127.0.0.1:47311"]
    assert not peer["relay"]
    # The node process that opened the store dropped them, saying so once in its log.
    (warning,) = _dropped(bob)
    assert "WARNING" in warning and "peer alice: dropped 'a..b:47000'" in warning
    assert "'r..x:4799'" in warning and "pair again with a fresh code" in warning
    assert _stored(bob, "peers", "alice") == (["127.0.0.1:47311"], "")

    again = gpumesh(bob, "peers", "--json")
    assert again.returncode == 0 and again.stderr == "" and len(_dropped(bob)) == 1


def _dropped(home: Path) -> list[str]:
    """The lines of ``home``'s node log that say stored hints were dropped."""
    log = (home / "logs" / "node.log").read_text()
    return [line for line in log.splitlines() if "dropped" in line and "stored for it" in line]


@pytest.mark.parametrize("hint", ESCAPING)
def test_connect_and_run_group_fail_in_one_line_on_a_stored_bad_hint(
    bob: Path, tmp_path: Path, hint: str
) -> None:
    """alice is paired and in bob's group; bob's store holds only a bad hint for her
    (as a node paired before hints were checked does): each command fails as for
    a peer that cannot be reached, never as a crash."""
    alice = tmp_path / "a"
    _init(alice, "alice", _free_udp_port())
    assert gpumesh(alice, "group", "create", "research").returncode == 0
    invite = gpumesh(alice, "group", "invite", "research").stdout
    assert gpumesh(bob, "group", "join", invite).returncode == 0
    assert gpumesh(bob, "pair", "--offline", gpumesh(alice, "pair-code").stdout).returncode == 0
    # The store as an older version left it: written while no node process holds it.
    assert gpumesh(bob, "daemon", "stop").returncode == 0
    _set_hints(bob, "peers", "alice", [hint], "")
    _set_hints(bob, "group_members", "alice", [hint], "")

    connect = gpumesh(bob, "connect", "alice")
    assert connect.returncode == 4, connect.stderr
    assert "Traceback" not in connect.stderr
    (error,) = _errors(connect.stderr)
    assert error == "error: no known address for alice: pair again with a fresh code"
    # bob's node process opened the store and dropped the hint, saying so in its log.
    assert f"peer alice: dropped {hint[:60]!r}" in (bob / "logs" / "node.log").read_text()

    run = gpumesh(bob, "run", "--group", "research", "--explain", "--", "true")
    # 2: what a group none of whose members can take the job always exits with.
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    assert _errors(run.stderr) == [
        "error: no member can take the job: alice: unreachable: no known address for "
        "alice: pair again with a fresh code"
    ]


def test_a_peer_named_by_its_host_name_is_reached(bob: Path, tmp_path: Path) -> None:
    """A host name is a good hint: the dial looks it up (sockets and QUIC take only
    IP literals) and reaches the node there."""
    alice = tmp_path / "a"
    port = _free_udp_port()
    _init(alice, "alice", port)
    share = _start_share(alice)
    try:
        code = make_code(Identity.load(alice / "identity.key"), "alice", [f"localhost:{port}"])
        paired = gpumesh(bob, "pair", code)
        assert paired.returncode == 0, paired.stderr
        assert "addresses  localhost:" in paired.stdout
        assert gpumesh(alice, "pair", gpumesh(bob, "pair-code").stdout).returncode == 0
        connect = gpumesh(bob, "connect", "alice")
        assert connect.returncode == 0, connect.stderr
    finally:
        share.kill()
        share.wait()
        for pipe in (share.stdout, share.stderr):
            if pipe is not None:
                pipe.close()


def test_through_the_node_process_a_bad_hint_written_under_it_fails_in_one_line(
    bob: Path, tmp_path: Path
) -> None:
    """bob's node process is running when the bad hint lands in the store (it read
    the store before): `connect` and `run --group` through it still end in one
    line with the in-process command's exit code, never "internal error in the
    control API" or "the node process stopped"."""
    alice = tmp_path / "a"
    _init(alice, "alice", _free_udp_port())
    assert gpumesh(alice, "group", "create", "research").returncode == 0
    invite = gpumesh(alice, "group", "invite", "research").stdout
    assert gpumesh(bob, "group", "join", invite).returncode == 0
    assert gpumesh(bob, "pair", "--offline", gpumesh(alice, "pair-code").stdout).returncode == 0
    try:
        started = cli(bob, "jobs")  # a command starts the node process
        assert started.returncode == 0, started.stderr
        assert status(bob)["running"] is True
        for hint in ESCAPING:
            _set_hints(bob, "peers", "alice", [hint], "")
            _set_hints(bob, "group_members", "alice", [hint], "")
            connect = cli(bob, "connect", "alice", "--timeout", "3")
            assert connect.returncode == 4, connect.stderr
            assert "Traceback" not in connect.stderr
            (error,) = _errors(connect.stderr)
            assert error == "error: no known address for alice: pair again with a fresh code"

            run = cli(bob, "run", "--group", "research", "--explain", "--", "true")
            assert run.returncode == 2, run.stderr
            (error,) = _errors(run.stderr)
            assert error.startswith("error: no member can take the job: alice: unreachable")
            assert "node process" not in error
    finally:
        cli(bob, "daemon", "stop")
