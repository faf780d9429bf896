"""Owner actions reach a share only through its node process's API: a sharing
home has none of the side channels it once had (a status file, a notification
socket, stop-request files, a CUDA sessions file, a SIGUSR1 handler, a periodic
re-read of the allowlist), and what the owner asks still acts at once. Real
node processes on real unix sockets, real QUIC on loopback; ``job_network none``
(no firewall rules) and no Docker: nothing here runs a job."""

from __future__ import annotations

import signal
import sqlite3
import time
from pathlib import Path

import pytest

from tests.integration.conftest import until
from tests.integration.node import cli, share_view
from tests.integration.test_cli import _free_udp_port

pytestmark = pytest.mark.usefixtures("gpumesh_processes")

GONE = ("agent.json", "agent.sock", "session-stops", "cuda-sessions.json")
"""What a sharing home held for other processes before the node process owned it."""
POLL_WAS = 5.0
"""Seconds between the allowlist re-reads an agent used to do."""


def _home(path: Path, name: str, *settings: tuple[str, str]) -> Path:
    assert cli(path, "init", "--name", name).returncode == 0
    for key, value in settings:
        assert cli(path, "config", "set", key, value).returncode == 0
    return path


def _links(home: Path) -> list[str]:
    view = share_view(home)
    assert view is not None and view["sharing"], view
    return [link["peer"] for link in view["agent"]["links"]]


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (its SigCgt mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    raise AssertionError("no SigCgt line")


def test_a_sharing_home_has_no_side_channels_and_owner_actions_act_at_once(
    tmp_path: Path,
) -> None:
    alice = _home(
        tmp_path / "a",
        "alice-pc",
        ("listen_host", "127.0.0.1"),
        ("listen_port", str(_free_udp_port())),
        ("job_network", "none"),
    )
    bob = _home(tmp_path / "b", "bob-laptop")
    shared = cli(alice, "share", "--detach")
    assert shared.returncode == 0, shared.stderr
    assert cli(bob, "pair", cli(alice, "pair-code").stdout.strip()).returncode == 0
    assert cli(alice, "pair", cli(bob, "pair-code").stdout.strip()).returncode == 0
    # bob's node process keeps its session to alice warm: a link alice's agent holds.
    assert cli(bob, "connect", "alice-pc").returncode == 0
    until(lambda: _links(alice) == ["bob-laptop"], "bob's link at alice")

    # Every owner action, through the node process.
    for args in (
        ("desktop", "share", "--port", "5999"),
        ("desktop", "allow", "bob-laptop"),
        ("desktop", "deny", "bob-laptop"),
        ("cuda", "share"),
        ("cuda", "allow", "bob-laptop"),
        ("cuda", "deny", "bob-laptop"),
        ("config", "set", "max_links_per_peer", "8"),
        ("sync", "--no-dial"),
    ):
        done = cli(alice, *args)
        assert done.returncode == 0, (args, done.stdout, done.stderr)
    gone = cli(alice, "cancel", "shell-5d1e0b9a4c2f")
    assert gone.returncode != 0 and "no open shell session" in gone.stderr
    assert _links(alice) == ["bob-laptop"]  # none of them was about bob's link

    view = share_view(alice)
    assert view is not None
    pid = view["agent"]["pid"]
    assert not _catches(pid, signal.SIGUSR1)
    left = sorted(path.name for path in alice.iterdir() if path.name in GONE)
    assert left == []
    sockets = sorted(path.name for path in alice.rglob("*") if path.is_socket())
    assert sockets == ["control.sock"]

    # The allowlist is not re-read behind the API's back: a row changed by hand
    # leaves bob's open link alone...
    with sqlite3.connect(alice / "gpumesh.db") as db:
        db.execute("UPDATE peers SET allowed = 0")
    time.sleep(POLL_WAS + 1.5)
    assert _links(alice) == ["bob-laptop"]
    # ...and `deny`, through the node process, closes it at once.
    assert cli(alice, "allow", "bob-laptop").returncode == 0
    denied = cli(alice, "deny", "bob-laptop")
    assert denied.returncode == 0, denied.stderr
    until(lambda: _links(alice) == [], "bob's link closed by the deny", within=10)
