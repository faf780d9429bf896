"""A friend as the relay, for real: in the NAT lab's matrix, bob behind a *home*
NAT and alice behind a *symmetric* one cannot punch, and no `gpumesh-relay`
exists; carol, on the public segment, has paired and allowed both (and they
her) and shares with ``relay_for_peers = true``. bob reaches alice through
carol (`connect` says ``relayed (peer carol-box)``), carol's `status` shows the
session and its bytes, a second session past ``relay_for_peers_sessions`` is
refused with the reason in bob's `connect`, and `gpumesh deny bob` on carol
ends the relayed session at both ends at once.

Needs root, iproute2 and iptables; in CI never skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.cli import run_cli
from tests.conftest import _in_ci, _network_lab_missing, end_node_processes
from tests.integration.node import node_env

pytestmark = pytest.mark.usefixtures("network_lab", "gpumesh_processes")

ROOT = Path(__file__).resolve().parents[2]
NATLAB = ROOT / "scripts" / "natlab.sh"
PREFIX = "gmf"
"""Namespaces of their own, apart from the other NAT lab tests'."""
BIN = Path(sys.executable).parent
CEILING = 30.0
"""Generous: events are awaited, never timed."""


def _natlab(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(NATLAB), *args],
        check=False,
        env=dict(os.environ, GPUMESH_NATLAB_PREFIX=PREFIX),
        capture_output=True,
        text=True,
        timeout=120,
    )


@dataclass(frozen=True)
class Node:
    name: str
    namespace: str
    home: Path

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """``gpumesh ARGS`` in this node's namespace, for its home."""
        return subprocess.run(
            ["ip", "netns", "exec", self.namespace, str(BIN / "gpumesh"), *args],
            check=False,
            env=node_env(self.home),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def ok(self, *args: str) -> str:
        result = self.run(*args)
        assert result.returncode == 0, (self.name, args, result.stdout, result.stderr)
        return result.stdout

    def status(self) -> dict[str, Any]:
        view: dict[str, Any] = json.loads(self.ok("status", "--json", "--offline"))
        return view


@dataclass(frozen=True)
class Trio:
    bob: Node
    alice: Node
    carol: Node


def _until(what: str, check: Any, ceiling: float = CEILING) -> Any:
    deadline = time.monotonic() + ceiling
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, f"not within {ceiling:g} s: {what}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trio]:
    missing = _network_lab_missing()
    if missing:
        if _in_ci():
            pytest.fail(f"CI runs the network lab tests: {missing}")
        pytest.skip(f"network lab unavailable: {missing}")
    built = _natlab("matrix")
    folder = tmp_path_factory.mktemp("peerrelay")
    try:
        assert built.returncode == 0, built.stderr
        namespaces = {
            (preset, int(number)): namespace
            for preset, number, namespace, *_ in (
                line.split() for line in built.stdout.splitlines()
            )
        }
        made = Trio(
            bob=Node("bob-laptop", namespaces["home", 1], folder / "bob"),
            alice=Node("alice-pc", namespaces["symmetric", 2], folder / "alice"),
            carol=Node("carol-box", f"{PREFIX}P", folder / "carol"),
        )
        nodes = (made.bob, made.alice, made.carol)
        for node in nodes:
            for args in (
                ["init", "--name", node.name],
                ["config", "set", "job_network", "bridge"],
                ["config", "set", "lan_discovery", "off"],
            ):
                result = run_cli(args, node_env(node.home))
                assert result.returncode == 0, (node.name, args, result.stderr)
        for key, value in (("relay_for_peers", "true"), ("relay_for_peers_sessions", "1")):
            result = run_cli(["config", "set", key, value], node_env(made.carol.home))
            assert result.returncode == 0, result.stderr
        made.carol.ok("share", "--detach")
        made.alice.ok("share", "--detach")
        codes = {node.name: node.ok("pair-code").strip() for node in nodes}
        for one, other in (
            (made.bob, made.carol),
            (made.alice, made.carol),
            (made.bob, made.alice),
        ):
            one.ok("pair", "--offline", codes[other.name])
            other.ok("pair", "--offline", codes[one.name])
        yield made
    finally:
        down = _natlab("down")  # ends every process in its namespaces, node processes too
        end_node_processes(folder)
        assert down.returncode == 0, down.stderr
        left = _natlab("check")
        assert left.returncode == 0, f"the NAT lab left things behind: {left.stderr}"


def test_a_home_and_a_symmetric_nat_meet_through_a_friend_and_a_deny_there_cuts_them(
    trio: Trio,
) -> None:
    bob, alice, carol = trio.bob, trio.alice, trio.carol
    # Each learns from carol's Welcome that she relays; alice, sharing, registers there.
    bob.ok("connect", carol.name)
    alice.ok("connect", carol.name)
    _until(
        "alice registered with carol's relay",
        lambda: alice.name in (carol.status()["relaying"] or {}).get("registered", []),
    )

    connected = bob.run("connect", alice.name, "--json")
    assert connected.returncode == 0, connected.stderr
    assert json.loads(connected.stdout)["path"] == f"relayed (peer {carol.name})"
    plain = bob.ok("connect", alice.name)
    assert f"relayed (peer {carol.name})" in plain

    relaying = carol.status()["relaying"]
    [session] = relaying["sessions"]
    assert (session["a"], session["b"], session["state"]) == (bob.name, alice.name, "active")
    assert session["bytes"] > 0
    assert relaying["max_sessions"] == 1
    shown = carol.ok("status")
    assert f"Relaying {bob.name} -> {alice.name}" in shown

    # Past relay_for_peers_sessions (1): a fresh dial is refused, and says why.
    refused = bob.run("connect", alice.name, "--fresh")
    assert refused.returncode != 0
    [line] = refused.stderr.strip().splitlines()
    assert f"peer {carol.name}" in line and "relay-full" in line, line
    assert carol.status()["relaying"]["refusals"].get("relay-full", 0) >= 1

    # The warm session still works; then carol denies bob: it ends at both ends now.
    assert f"relayed (peer {carol.name})" in bob.ok("connect", alice.name)
    carol.ok("deny", bob.name)
    _until("carol relays nothing", lambda: not carol.status()["relaying"]["sessions"])
    _until(
        "alice's link from bob closed",
        lambda: all(link["peer"] != bob.name for link in alice.status()["connections"]),
    )
    again = bob.run("connect", alice.name, "--timeout", "8")
    assert again.returncode != 0
    [line] = again.stderr.strip().splitlines()
    assert f"peer {carol.name}" in line, line
    assert bob.name not in carol.status()["relaying"]["registered"]
