"""Paired nodes on one LAN find each other with no server: with a stale stored
address and no registry, relay or route anywhere, through the multicast
announcements, and through the unicast re-probe where a firewall drops multicast.
A capture of the announcements names nobody; a stranger's announcements, replayed
ones and a flood of junk change nothing (a replay costs at most one failed dial).

alice shares in ``lana`` (10.77.0.1), bob runs his node process in ``lanb``
(10.77.0.2), the stranger and the capture live in ``lanc`` (10.77.0.3), all on one
bridge (:mod:`tests.integration.lanlab`). Announcements every second. Needs root
and iproute2; in CI these are never skipped.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpumesh.identity.keys import Identity
from tests.integration import lanlab
from tests.integration.lanlab import Running, ip_of
from tests.integration.test_cli import _free_udp_port

pytestmark = pytest.mark.usefixtures("network_lab", "gpumesh_processes")

ALICE_IP, BOB_IP, STRANGER_IP = ip_of("a"), ip_of("b"), ip_of("c")


@dataclass
class Lan:
    tmp: Path
    alice: Path
    bob: Path
    port: int
    """The port alice shares on now (her pairing code said another)."""

    def start_alice(self) -> Running:
        alice = lanlab.start("a", self.alice, share=True)
        lanlab.until(lambda: "sharing on udp" in alice.log, "alice shares")
        return alice

    def start_bob(self) -> Running:
        bob = lanlab.start("b", self.bob, share=False)
        lanlab.until(lambda: "LAN discovery on UDP" in bob.log, "bob listens")
        return bob


def _lan(tmp: Path, stale_host: str) -> Lan:
    """alice and bob paired both ways; bob knows alice at ``stale_host`` and a port
    she no longer shares on."""
    old, new = _free_udp_port(), _free_udp_port()
    alice, code_a = lanlab.make_home(tmp / "a", "alice-pc", stale_host, old)
    bob, code_b = lanlab.make_home(tmp / "b", "bob-laptop", BOB_IP, 47000)
    bob.pair(code_a)
    alice.pair(code_b)
    for node in (alice, bob):
        node.close()
    lanlab.set_config(tmp / "a", listen_host="0.0.0.0", listen_port=str(new))
    return Lan(tmp, tmp / "a", tmp / "b", new)


@pytest.fixture
def lan(tmp_path: Path) -> Iterator[Lan]:
    with lanlab.bridge():
        yield _lan(tmp_path, "10.77.0.99")  # an address nobody has


def _lan_path(bob: Running, port: int) -> bool:
    alice = bob.peers().get("alice-pc")
    return alice is not None and (alice.last_path, alice.last_address) == (
        "lan",
        f"{ALICE_IP}:{port}",
    )


def _forms(key: bytes) -> list[bytes]:
    """A public key as it could appear: raw, hex, base64 (both alphabets), base32."""
    forms = [key, key.hex().encode(), key.hex().upper().encode(), base64.b32encode(key)]
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        forms += [encode(key), encode(key).rstrip(b"=")]
    return forms


def test_paired_nodes_find_each_other_and_the_capture_names_nobody(lan: Lan) -> None:
    # A stranger in lanc shares and announces to a peer of its own (not running).
    stranger, _ = lanlab.make_home(lan.tmp / "c", "stranger", STRANGER_IP, 47000)
    other, code_d = lanlab.make_home(lan.tmp / "d", "stranger-friend", "10.77.0.4", 47000)
    stranger.pair(code_d)
    for node in (stranger, other):
        node.close()
    capture_file = lan.tmp / "captured.txt"
    capture = lanlab.helper("c", "capture", str(capture_file))
    them = lanlab.start("c", lan.tmp / "c", share=True)
    alice = lan.start_alice()
    bob = lan.start_bob()
    try:
        lanlab.until(lambda: _lan_path(bob, lan.port), "bob reaches alice on the LAN")
        # The LAN session is the warm one: `connect` uses it, on the LAN path.
        assert "path lan" in _connect(lan, bob), bob.log
        lanlab.until(
            lambda: f"from {STRANGER_IP}:47099 dropped: no paired peer's tag" in bob.log,
            "bob drops the stranger's announcements",
        )
        assert set(bob.peers()) == {"alice-pc"}
        assert set(alice.peers()) == {"bob-laptop"}
        assert STRANGER_IP not in _dials(bob) and STRANGER_IP not in _dials(alice)
        # (The stranger's own, sent without loopback, never reach the capture beside it.)
        lanlab.until(
            lambda: _sources(capture_file) >= {ALICE_IP, BOB_IP},
            "the capture holds alice's and bob's announcements",
        )
    finally:
        for running in (bob, alice, them):
            running.stop()
        capture.kill()
        capture.wait()
    packets = [bytes.fromhex(line.split()[1]) for line in capture_file.read_text().splitlines()]
    forbidden: list[bytes] = []
    for home, name in (
        (lan.alice, "alice-pc"),
        (lan.bob, "bob-laptop"),
        (lan.tmp / "c", "stranger"),
        (lan.tmp / "d", "stranger-friend"),
    ):
        identity = Identity.load(home / "identity.key")
        node_id = str(identity.node_id)
        forbidden += [
            name.encode(),
            node_id.encode(),
            node_id[:12].encode(),
            node_id.upper().encode(),
            *_forms(identity.public_key),
        ]
    for packet in packets:
        assert packet.startswith(b"gmL\x01")
        for secret in forbidden:
            assert secret not in packet, (secret, packet.hex())
    # Every datagram's tags are fresh: none repeats across the capture.
    tags = [p[15 + i : 25 + i] for p in packets for i in range(0, len(p) - 15, 10)]
    assert len(tags) == len(set(tags))


def test_replayed_and_junk_announcements_change_nothing(lan: Lan) -> None:
    capture_file = lan.tmp / "captured.txt"
    capture = lanlab.helper("c", "capture", str(capture_file))
    alice = lan.start_alice()
    try:
        lanlab.until(
            lambda: _announced_port(capture_file, ALICE_IP),
            "an announcement of alice's share is captured",
        )
    finally:
        alice.stop()  # from now on, only the replays claim to be alice
        capture.kill()
        capture.wait()
    recorded = lan.tmp / "alice.txt"
    recorded.write_text(
        "".join(
            line + "\n"
            for line in capture_file.read_text().splitlines()
            if line.startswith(ALICE_IP + " ") and _port_of(line)
        )
    )
    bob = lan.start_bob()
    try:
        for _ in range(3):
            assert lanlab.helper("c", "send", str(recorded), BOB_IP).wait(timeout=30) == 0
        lanlab.until(lambda: "dropped: replayed" in bob.log, "bob drops the replays")
        lanlab.until(lambda: "LAN: no session with alice-pc" in bob.log, "the one dial fails")
        flood = lanlab.helper("c", "flood", BOB_IP, "3000")
        assert flood.wait(timeout=60) == 0
        lanlab.until(lambda: "dropped: rate-limited" in bob.log, "bob limits the flood")
        assert bob.peers()["alice-pc"].last_path is None, bob.log  # nothing stored
        assert bob.process.poll() is None
    finally:
        bob.stop()
    assert _dials(bob) == [STRANGER_IP], bob.log  # one dial, to the replayer
    assert "malformed" in bob.log
    assert "Traceback" not in bob.log
    # A flood is a line per source, not a line per datagram.
    assert bob.log.count("dropped: rate-limited") <= 3, bob.log.count("dropped: rate-limited")


@pytest.fixture
def filtered(tmp_path: Path) -> Iterator[Lan]:
    with lanlab.bridge():
        lanlab.drop_multicast("a")
        lanlab.drop_multicast("b")
        yield _lan(tmp_path, ALICE_IP)  # the right host, a stale port


def test_where_multicast_is_dropped_the_unicast_reprobe_connects(filtered: Lan) -> None:
    alice = filtered.start_alice()
    bob = filtered.start_bob()
    try:
        lanlab.until(lambda: _lan_path(bob, filtered.port), "bob reaches alice on the LAN")
    finally:
        bob.stop()
        alice.stop()


def _connect(lan: Lan, bob: Running) -> str:
    import os
    import subprocess
    import sys

    env = dict(os.environ, GPUMESH_HOME=str(lan.bob))
    env.pop("GPUMESH_LOG", None)
    result = subprocess.run(
        ["ip", "netns", "exec", "lanb", sys.executable, "-m", "gpumesh", "connect", "alice-pc"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, (result.stdout, result.stderr, bob.log)
    return result.stdout


def _dials(node: Running) -> list[str]:
    """The hosts the node dialled on a LAN hint."""
    return re.findall(r"LAN: \S+ announced (\S+):\d+; dialling", node.log)


def _port_of(line: str) -> int:
    """The port a captured announcement (``SOURCE HEX``) says its node shares on."""
    return int(line.split()[1][10:14], 16)


def _announced_port(capture: Path, source: str) -> bool:
    """Whether the capture holds an announcement from ``source`` with a port."""
    if not capture.exists():
        return False
    lines = capture.read_text().splitlines()
    return any(line.startswith(source + " ") and _port_of(line) for line in lines)


def _sources(capture: Path) -> set[str]:
    if not capture.exists():
        return set()
    return {line.split()[0] for line in capture.read_text().splitlines() if line.strip()}
