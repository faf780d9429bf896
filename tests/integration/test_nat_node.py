"""Behind the NAT lab (scripts/natlab.sh, as in test_nat.py), through bob's real
node process: commands after the first reuse its punched direct path and its one
relay registration. Read from the node process's status and the relay's log,
never from timing. Needs root, iproute2 and iptables; in CI never skipped."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration import test_nat
from tests.integration.node import CEILING, node_env
from tests.integration.test_nat import Lab, _build_lab

pytestmark = pytest.mark.usefixtures("gpumesh_processes")

PREFIX = "gmn"
"""Namespaces of their own, apart from test_nat.py's."""


@pytest.fixture
def lab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, network_lab: None) -> Iterator[Lab]:
    monkeypatch.setattr(test_nat, "PREFIX", PREFIX)
    built = _build_lab(tmp_path, "drop")
    lab = next(built)
    try:
        yield lab
    finally:
        _node(lab, "daemon", "stop")
        next(built, None)


def _node(lab: Lab, *args: str) -> subprocess.CompletedProcess[str]:
    """``gpumesh ARGS`` of bob (home A, behind his NAT) through his node process,
    which the first command starts in his namespace."""
    return subprocess.run(
        ["ip", "netns", "exec", f"{PREFIX}A", sys.executable, "-m", "gpumesh", *args],
        env=node_env(lab.a),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _node_status(lab: Lab) -> dict[str, Any]:
    result = _node(lab, "daemon", "status", "--json")
    assert result.returncode == 0, result.stderr
    node: dict[str, Any] = json.loads(result.stdout)["node"]
    return node


def _echo(lab: Lab, text: str) -> None:
    result = _node(lab, "run", "--peer", "alice-pc", "--", "echo", text)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{text}\n"


def _punched(lab: Lab) -> dict[str, Any]:
    """alice's warm session once punching moved it off the relay."""
    deadline = time.monotonic() + CEILING
    while True:
        warm = {w["peer"]: w for w in _node_status(lab)["warm_sessions"]}
        session = warm.get("alice-pc")
        if session is not None and session["path"].startswith("direct (hole-punched)"):
            return session
        assert time.monotonic() < deadline, f"never punched: {warm}"
        time.sleep(0.2)


@pytest.mark.usefixtures("docker_daemon")
def test_a_second_command_behind_nat_reuses_the_punched_path_and_the_registration(
    lab: Lab,
) -> None:
    log = lab.tmp / "relay.log"
    before = len(log.read_text())
    _echo(lab, "one")
    first = _punched(lab)
    assert first["path"].startswith("direct (hole-punched) 203.0.113.3:")
    _echo(lab, "two")
    second = _node_status(lab)
    warm = {w["peer"]: w for w in second["warm_sessions"]}
    # The same session carried it (more uses), still on the punched path.
    assert warm["alice-pc"]["uses"] > first["uses"]
    assert warm["alice-pc"]["path"].startswith("direct (hole-punched) 203.0.113.3:")
    relays = second["outgoing"]["relays"]
    assert len(relays) == 1 and relays[0]["state"].startswith("registered as 203.0.113.2:")

    # Drop the session: the re-dial goes through the registration already made.
    assert _node(lab, "deny", "alice-pc").returncode == 0
    deadline = time.monotonic() + CEILING
    while any(w["peer"] == "alice-pc" for w in _node_status(lab)["warm_sessions"]):
        assert time.monotonic() < deadline, "the denied peer's session stayed warm"
        time.sleep(0.1)
    assert _node(lab, "allow", "alice-pc").returncode == 0
    _echo(lab, "three")
    third = _punched(lab)
    assert third["uses"] < warm["alice-pc"]["uses"]  # a new session
    assert third["local_port"] == first["local_port"] == second["outgoing"]["port"]
    after = _node_status(lab)["outgoing"]["relays"]
    assert after[0]["registrations"] == 1
    # The relay saw bob's node process register once, and both sessions come from it.
    bob = lab.node_id(lab.a)
    text = log.read_text()[before:]
    sources = re.findall(rf"registered {re.escape(bob)} from (\S+) \(dialing\)", text)
    assert len(sources) == 1, text
    assert len(re.findall(rf"{re.escape(sources[0])} -> 203\.0\.113\.3:", text)) == 2, text


@pytest.mark.usefixtures("docker_daemon")
def test_after_the_provider_drops_the_session_the_re_dial_goes_straight_to_the_punched_address(
    lab: Lab,
) -> None:
    _echo(lab, "one")
    first = _punched(lab)
    opened = lab.relay_stats()["sessions_opened"]
    assert opened == 1, opened
    # alice ends the session from her side: her deny closes bob's links at once.
    assert lab.gpumesh("B", lab.b, "deny", "bob-laptop").returncode == 0
    deadline = time.monotonic() + CEILING
    while any(w["peer"] == "alice-pc" for w in _node_status(lab)["warm_sessions"]):
        assert time.monotonic() < deadline, "the closed session stayed warm"
        time.sleep(0.1)
    assert lab.gpumesh("B", lab.b, "allow", "bob-laptop").returncode == 0
    _echo(lab, "two")
    warm = {w["peer"]: w for w in _node_status(lab)["warm_sessions"]}
    second = warm["alice-pc"]
    assert second["uses"] <= first["uses"]  # a new session...
    # ...dialled straight to the address punching found for the first one, from the
    # same shared socket: the relay was not asked for a session again.
    assert second["path"] == first["path"]
    assert second["local_port"] == first["local_port"]
    assert lab.relay_stats()["sessions_opened"] == opened
    _echo(lab, "three")  # and it carries the next command as a warm session does
    assert lab.relay_stats()["sessions_opened"] == opened
