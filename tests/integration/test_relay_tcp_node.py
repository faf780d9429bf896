"""A node on a network that blocks UDP reaches its peer through the relay over
TCP/TLS, by itself: straight, through an HTTP CONNECT proxy with direct TCP out
blocked, and through a TLS-terminating proxy with a certificate of its own; a
proxy that refuses, a middlebox that breaks TLS and a relay that does not admit
the node each end in one line naming the path and why.

bob lives in a network namespace whose firewall drops what the test says
(iptables, silently: nothing answers, as on a hotel or corporate network); the
relay, alice (sharing) and the middleboxes run in this machine's namespace. Needs
root, iproute2 and iptables; in CI these are never skipped.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpumesh.identity.keys import Identity
from tests.integration.conftest import gpumesh
from tests.integration.tcpmiddleboxes import middleboxes
from tests.integration.test_cli import _free_udp_port, _one_line_error, _start_share

pytestmark = pytest.mark.usefixtures("network_lab", "gpumesh_processes")

NS = "rlytcp"
HOST_IP, BOB_IP = "10.79.0.1", "10.79.0.2"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _ns(*args: str) -> None:
    subprocess.run(["ip", "netns", "exec", NS, *args], check=True, capture_output=True, timeout=30)


def _remove_namespace() -> None:
    pids = subprocess.run(
        ["ip", "netns", "pids", NS], capture_output=True, text=True, check=False
    ).stdout.split()
    for pid in pids:
        subprocess.run(["kill", "-9", pid], check=False, capture_output=True)
    subprocess.run(["ip", "netns", "del", NS], check=False, capture_output=True)
    subprocess.run(["ip", "link", "del", f"{NS}h"], check=False, capture_output=True)


@dataclass
class Walled:
    """bob behind a firewall, alice sharing, the relay between them."""

    tmp: Path
    alice: Path
    bob: Path
    relay_udp: str
    relay_tcp: str
    env: dict[str, str] = field(default_factory=dict)

    def bob_cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, GPUMESH_HOME=str(self.bob), **self.env)
        env.pop("GPUMESH_LOG", None)
        return subprocess.run(
            ["ip", "netns", "exec", NS, sys.executable, "-m", "gpumesh", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def block(self, *rules: list[str]) -> None:
        """bob's firewall: no UDP in or out; loopback and answers pass, then ``rules``,
        then nothing."""
        for chain in ("INPUT", "OUTPUT"):
            _ns("iptables", "-F", chain)
        _ns("iptables", "-A", "INPUT", "-p", "udp", "-j", "DROP")
        _ns("iptables", "-A", "OUTPUT", "-o", "lo", "-j", "ACCEPT")
        _ns("iptables", "-A", "OUTPUT", "-p", "udp", "-j", "DROP")
        _ns("iptables", "-A", "OUTPUT", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
            "-j", "ACCEPT")  # fmt: skip
        for rule in rules:
            _ns("iptables", "-A", "OUTPUT", *rule)
        _ns("iptables", "-A", "OUTPUT", "-j", "DROP")


def _start_relay(tmp: Path, *args: str) -> tuple[subprocess.Popen[str], str, str]:
    port = _free_udp_port()
    log = tmp / "relay.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpumesh.relay.main", "--listen", f"{HOST_IP}:{port}",
             "--tcp", f"{HOST_IP}:0", "--keepalive", "2s", *args],
            stdout=out, stderr=out, text=True,
        )  # fmt: skip
    deadline = time.monotonic() + 15
    while (found := re.search(r"and tcp (\S+)", log.read_text())) is None:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    return proc, f"{HOST_IP}:{port}", found.group(1)


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
    proc.communicate(timeout=30)


@pytest.fixture
def walled(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Walled]:
    _remove_namespace()
    _ip("netns", "add", NS)
    _ip("link", "add", f"{NS}h", "type", "veth", "peer", "name", f"{NS}b")
    _ip("link", "set", f"{NS}b", "netns", NS)
    _ip("addr", "add", f"{HOST_IP}/24", "dev", f"{NS}h")
    _ip("link", "set", f"{NS}h", "up")
    _ns("ip", "link", "set", "lo", "up")
    _ns("ip", "addr", "add", f"{BOB_IP}/24", "dev", f"{NS}b")
    _ns("ip", "link", "set", f"{NS}b", "up")
    _ns("ip", "route", "add", "default", "via", HOST_IP)
    alice = tmp_path / "a"
    assert gpumesh(alice, "init", "--name", "alice-pc").returncode == 0
    # "private": a relay that admits alice alone
    private = getattr(request, "param", "") == "private"
    allow = ("--allow", str(Identity.load(alice / "identity.key").node_id)) if private else ()
    relay, relay_udp, relay_tcp = _start_relay(tmp_path, *(allow or ("--open",)))
    lab = Walled(tmp_path, alice, tmp_path / "b", relay_udp, relay_tcp)
    share = None
    try:
        for key, value in (("listen_host", HOST_IP), ("listen_port", str(_free_udp_port())),
                           ("relay", relay_udp), ("relay_tcp", relay_tcp)):  # fmt: skip
            assert gpumesh(lab.alice, "config", "set", key, value).returncode == 0
        assert lab.bob_cli("init", "--name", "bob-laptop").returncode == 0
        for key, value in (("relay", relay_udp), ("relay_tcp", relay_tcp),
                           ("relay_udp_retry", "1s")):  # fmt: skip
            assert lab.bob_cli("config", "set", key, value).returncode == 0
        code_a = gpumesh(lab.alice, "pair-code").stdout.strip()
        code_b = lab.bob_cli("pair-code").stdout.strip()
        assert lab.bob_cli("pair", code_a).returncode == 0
        assert gpumesh(lab.alice, "pair", code_b).returncode == 0
        assert lab.bob_cli("daemon", "stop").returncode == 0
        share = _start_share(lab.alice)
        _wait(lambda: "registered" in _status(lab.alice).get("relay_state", ""), "alice registers")
        yield lab
    finally:
        lab.bob_cli("daemon", "stop")
        if share is not None:
            _stop(share)
        _stop(relay)
        _remove_namespace()


def _status(home: Path) -> dict[str, str]:
    data: dict[str, str] = json.loads(gpumesh(home, "status", "--json").stdout)
    return data


def _wait(check, what: str, timeout: float = 30) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.2)


def _copy_round_trip(lab: Walled) -> None:
    source = lab.tmp / "up.bin"
    source.write_bytes(os.urandom(300_000))
    back = lab.tmp / "back.bin"
    up = lab.bob_cli("cp", str(source), "alice-pc:/up.bin")
    assert up.returncode == 0, up.stderr
    down = lab.bob_cli("cp", "alice-pc:/up.bin", str(back))
    assert down.returncode == 0, down.stderr
    assert back.read_bytes() == source.read_bytes()


def _connect(lab: Walled, *flags: str) -> subprocess.CompletedProcess[str]:
    return lab.bob_cli("connect", "alice-pc", *flags)


def test_without_udp_the_relay_is_reached_over_tcp(walled: Walled) -> None:
    walled.block(["-p", "tcp", "-j", "ACCEPT"])  # TCP anywhere, no UDP: not even to the relay
    result = _connect(walled, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["path"] == f"relayed (tcp) via {walled.relay_udp}"
    human = _connect(walled)
    assert "path relayed (tcp) via" in human.stdout, human.stdout
    _copy_round_trip(walled)
    daemon = walled.bob_cli("daemon", "status").stdout
    assert re.search(rf"relay {walled.relay_udp}\s+registered as .* \(over tcp\)", daemon), daemon
    checks = {c["name"]: c for c in json.loads(walled.bob_cli("doctor", "--json").stdout)}
    assert checks["relay"]["status"] == "warn", checks["relay"]
    assert "registration over TCP" in checks["relay"]["detail"]
    netcheck = json.loads(walled.bob_cli("netcheck", "--json").stdout)
    rows = {c["name"]: c["status"] for c in netcheck["checks"]}
    assert (rows["udp"], rows["tcp"], netcheck["reachable"]) == ("fail", "ok", True), netcheck


def test_through_a_connect_proxy_with_direct_tcp_blocked(walled: Walled) -> None:
    with middleboxes(HOST_IP, walled.tmp) as boxes:
        port = boxes.start_connect_proxy()
        walled.block(["-p", "tcp", "-d", HOST_IP, "--dport", str(port), "-j", "ACCEPT"])
        walled.env["HTTPS_PROXY"] = f"http://{HOST_IP}:{port}"
        result = _connect(walled, "--json")
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["path"].startswith("relayed (tcp)")
        assert walled.relay_tcp in boxes.connects
        _copy_round_trip(walled)


def test_through_a_tls_terminating_proxy_with_its_own_certificate(walled: Walled) -> None:
    host, _, port = walled.relay_tcp.rpartition(":")
    with middleboxes(HOST_IP, walled.tmp) as boxes:
        mitm = boxes.start_tls_terminator(host, int(port))
        walled.block(["-p", "tcp", "-j", "ACCEPT"])
        assert walled.bob_cli("config", "set", "relay_tcp", f"{HOST_IP}:{mitm}").returncode == 0
        result = _connect(walled, "--json")
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["path"].startswith("relayed (tcp)")
        # it read the node's upgrade in the clear: it did end the TLS
        assert any(head.startswith(b"GET /gpumesh/relay ") for head in boxes.terminated)
        _copy_round_trip(walled)


def test_a_refused_connect_or_broken_tls_is_said_in_one_line(walled: Walled) -> None:
    with middleboxes(HOST_IP, walled.tmp) as boxes:
        refusing = boxes.start_connect_proxy(refuse=True)
        breaker = boxes.start_tls_breaker()
        walled.block(["-p", "tcp", "-d", HOST_IP, "-j", "ACCEPT"])
        walled.env["HTTPS_PROXY"] = f"http://{HOST_IP}:{refusing}"
        result = _connect(walled, "--timeout", "6")
        _one_line_error(result, 4, f"the proxy {HOST_IP}:{refusing} refused CONNECT")
        assert "403 Forbidden" in result.stderr and "directly" in result.stderr
        walled.bob_cli("daemon", "stop")
        del walled.env["HTTPS_PROXY"]
        assert walled.bob_cli("config", "set", "relay_tcp", f"{HOST_IP}:{breaker}").returncode == 0
        result = _connect(walled, "--timeout", "6")
        _one_line_error(result, 4, f"TLS to {HOST_IP}:{breaker} failed")


def test_a_malformed_relay_tcp_is_refused_in_one_line(walled: Walled) -> None:
    result = walled.bob_cli("config", "set", "relay_tcp", "relay.example.org:99999")
    _one_line_error(result, 2, "invalid relay_tcp 'relay.example.org:99999'")


@pytest.mark.parametrize("walled", ["private"], indirect=True)
def test_a_private_relay_refuses_a_node_off_its_allowlist_over_tcp_too(
    walled: Walled,
) -> None:
    walled.block(["-p", "tcp", "-j", "ACCEPT"])
    result = _connect(walled, "--timeout", "6")
    _one_line_error(result, 4, "not-allowed")
