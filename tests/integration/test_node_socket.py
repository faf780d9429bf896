"""One UDP socket and one relay registration for every outgoing link of the node
process: real `gpumesh share` providers, a real `gpumesh-relay`, bob's commands
through his real node process. What the tests read is the node process's own
status (and the kernel's /proc/net/udp, and the relay's log), never timing."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from gpumesh.store.config import DEFAULT_LAN_PORT
from tests.integration.conftest import gpumesh, shared_pair
from tests.integration.node import CEILING, cli, status
from tests.integration.test_cli import _free_udp_port, _init, running_share
from tests.integration.test_relay_node import _start_relay, _stop

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")


def _setup(home: Path, name: str, **config: str) -> None:
    """``home`` initialised as ``name``, with ``config`` set."""
    image = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")
    _init(home, name, _free_udp_port())
    for key, value in {"image": image, **config}.items():
        assert gpumesh(home, "config", "set", key, value).returncode == 0


def _pair(a: Path, b: Path) -> None:
    assert gpumesh(b, "pair", gpumesh(a, "pair-code").stdout.strip()).returncode == 0
    assert gpumesh(a, "pair", gpumesh(b, "pair-code").stdout.strip()).returncode == 0


def _echo(home: Path, peer: str, text: str) -> None:
    result = cli(home, "run", "--peer", peer, "--", "echo", text)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{text}\n"


def _warm(home: Path) -> dict[str, dict[str, Any]]:
    return {w["peer"]: w for w in status(home)["node"]["warm_sessions"]}


def _udp_ports_of(pid: int) -> set[int]:
    """The local ports of the UDP sockets process ``pid`` holds, from the kernel."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/net/udp", "/proc/net/udp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                if fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_two_peers_and_a_redial_after_a_drop_leave_from_one_udp_port(tmp_path: Path) -> None:
    _setup(tmp_path / "c", "carol-pc")
    with shared_pair(tmp_path) as (_alice, bob), running_share(tmp_path / "c"):
        _pair(tmp_path / "c", bob)
        _echo(bob, "alice-pc", "one")
        node = status(bob)["node"]
        port = node["outgoing"]["port"]
        assert isinstance(port, int) and port > 0
        assert _warm(bob)["alice-pc"]["local_port"] == port
        _echo(bob, "carol-pc", "two")
        warm = _warm(bob)
        assert sorted(warm) == ["alice-pc", "carol-pc"]
        assert {w["local_port"] for w in warm.values()} == {port}
        assert status(bob)["node"]["outgoing"]["links"] == 2
        # The kernel agrees: the node process holds one UDP socket for its links, on
        # that port (beside LAN discovery's, which dials nothing).
        assert _udp_ports_of(node["pid"]) == {port, DEFAULT_LAN_PORT}

        # Drop alice's session (a deny closes it at once), allow her again, re-dial.
        assert cli(bob, "deny", "alice-pc").returncode == 0
        deadline = time.monotonic() + CEILING
        while "alice-pc" in _warm(bob):
            assert time.monotonic() < deadline, "the denied peer's session stayed warm"
            time.sleep(0.05)
        assert cli(bob, "allow", "alice-pc").returncode == 0
        _echo(bob, "alice-pc", "three")
        warm = _warm(bob)
        assert warm["alice-pc"]["local_port"] == port and warm["carol-pc"]["local_port"] == port
        after = status(bob)["node"]
        assert after["pid"] == node["pid"] and after["outgoing"]["port"] == port
        assert _udp_ports_of(node["pid"]) == {port, DEFAULT_LAN_PORT}


def test_a_dial_to_a_port_where_nothing_listens_is_refused_at_once(tmp_path: Path) -> None:
    """The shared socket is not connected, so the kernel's 'port unreachable' comes
    through its error queue; the dial still fails as refused, not after a timeout."""
    with shared_pair(tmp_path) as (_alice, bob):
        _echo(bob, "alice-pc", "one")  # the shared socket is open and warm
        port = status(bob)["node"]["outgoing"]["port"]
        carol = tmp_path / "c"
        _init(carol, "carol-pc", _free_udp_port())
        _pair(carol, bob)  # paired, but not sharing: nothing listens on her port
        result = cli(bob, "run", "--peer", "carol-pc", "--", "true")
        assert result.returncode != 0
        assert "nothing is listening on 127.0.0.1:" in result.stderr, result.stderr
        assert "\n" not in result.stderr.strip() and "Traceback" not in result.stderr
        assert status(bob)["node"]["outgoing"]["port"] == port
        _echo(bob, "alice-pc", "two")  # and the socket still carries alice


def _registrations(log: str, node_id: str) -> list[str]:
    """Where the relay's log says ``node_id`` registered from to dial."""
    return re.findall(rf"registered {re.escape(node_id)} from (\S+) \(dialing\)", log)


def test_two_relayed_peers_share_one_relay_registration(tmp_path: Path) -> None:
    proc, relay = _start_relay(tmp_path, "--open")
    log = next(tmp_path.glob("relay-*.log"))
    try:
        alice, carol, bob = tmp_path / "a", tmp_path / "c", tmp_path / "b"
        _setup(bob, "bob-laptop", relay=relay)
        for home, name in ((alice, "alice-pc"), (carol, "carol-pc")):
            _setup(home, name, relay=relay)
            _pair(home, bob)
            # They move after pairing: the addresses bob has answer no more (nothing
            # listens there), so only the relay reaches them.
            port = str(_free_udp_port())
            assert gpumesh(home, "config", "set", "listen_port", port).returncode == 0
        # Pairing's checks ran in bob's node process: the one measured starts here.
        assert gpumesh(bob, "daemon", "stop").returncode == 0
        with running_share(alice), running_share(carol):
            before = len(log.read_text())  # pairing's own checks registered too
            _echo(bob, "alice-pc", "one")
            _echo(bob, "carol-pc", "two")
            warm = _warm(bob)
            assert sorted(warm) == ["alice-pc", "carol-pc"]
            outgoing = status(bob)["node"]["outgoing"]
            assert [r["relay"] for r in outgoing["relays"]] == [relay]
            assert outgoing["relays"][0]["state"].startswith("registered as 127.0.0.1:")
            assert outgoing["relays"][0]["registrations"] == 1
            bob_id = json.loads(gpumesh(bob, "status", "--json").stdout)["node_id"]
            # One registration, from the node process's one socket, carried both sessions.
            text = log.read_text()[before:]
            assert _registrations(text, bob_id) == [f"127.0.0.1:{outgoing['port']}"], text
            assert len(re.findall(rf"127\.0\.0\.1:{outgoing['port']} ->", text)) == 2, text
    finally:
        _stop(proc)
