"""Nodes and a real `gpumesh-relay` on loopback: what the node side does with it.

(The NAT behaviours themselves are in test_nat.py, in network namespaces.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import gpumesh
from tests.integration.test_cli import _free_udp_port, _init, _one_line_error, _start_share

pytestmark = pytest.mark.usefixtures("gpumesh_processes")


def _start_relay(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    port = _free_udp_port()
    log = tmp_path / f"relay-{port}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpumesh.relay.main", "--listen", f"127.0.0.1:{port}", *args],
            stdout=out,
            stderr=out,
            text=True,
        )
    deadline = time.monotonic() + 10
    while "listening on" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    return proc, f"127.0.0.1:{port}"


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[str]:
    proc, address = _start_relay(tmp_path, "--open")
    yield address
    _stop(proc)


def _checks(home: Path) -> dict[str, dict[str, str]]:
    result = gpumesh(home, "doctor", "--json")
    return {c["name"]: c for c in json.loads(result.stdout)}


def test_doctor_checks_the_relay_and_what_the_network_lets_in(tmp_path: Path, relay: str) -> None:
    home = tmp_path / "n"
    _init(home, "node")
    assert _checks(home)["relay"]["status"] == "warn"  # none configured
    assert gpumesh(home, "config", "set", "relay", relay).returncode == 0
    checks = _checks(home)
    assert checks["relay"]["status"] == "ok", checks["relay"]
    assert "accepted this node's registration" in checks["relay"]["detail"]
    # On loopback nothing filters: the relay's probe from another port gets in.
    assert checks["nat"]["status"] == "ok"
    assert "no NAT" in checks["nat"]["detail"] and "get in" in checks["nat"]["detail"]


def test_doctor_reports_a_private_relay_that_refuses_this_node(tmp_path: Path) -> None:
    home = tmp_path / "n"
    _init(home, "node")
    token_file = tmp_path / "token"
    token_file.write_text("right-token\n")
    proc, address = _start_relay(tmp_path, "--token-file", str(token_file))
    try:
        assert gpumesh(home, "config", "set", "relay", address).returncode == 0
        assert gpumesh(home, "config", "set", "relay_token", "wrong-token").returncode == 0
        result = gpumesh(home, "doctor", "--json")
        checks = {c["name"]: c for c in json.loads(result.stdout)}
        assert result.returncode == 1
        assert checks["relay"]["status"] == "fail"
        assert "not-allowed" in checks["relay"]["detail"]
        node_id = json.loads(gpumesh(home, "status", "--json").stdout)["node_id"]
        assert node_id in checks["relay"]["fix"]
        assert gpumesh(home, "config", "set", "relay_token", "right-token").returncode == 0
        assert _checks(home)["relay"]["status"] == "ok"
    finally:
        _stop(proc)
    # and a relay that is gone: a clear failure, quickly
    started = time.monotonic()
    checks = _checks(home)
    assert checks["relay"]["status"] == "fail" and "no answer" in checks["relay"]["detail"]
    assert time.monotonic() - started < 10


def test_a_moved_peer_is_found_through_the_relay_and_its_new_address_kept(
    tmp_path: Path, relay: str
) -> None:
    alice, bob = tmp_path / "a", tmp_path / "b"
    _init(alice, "alice-pc", _free_udp_port())
    _init(bob, "bob-laptop")
    for home in (alice, bob):
        assert gpumesh(home, "config", "set", "relay", relay).returncode == 0
    assert gpumesh(bob, "pair", gpumesh(alice, "pair-code").stdout.strip()).returncode == 0
    assert gpumesh(alice, "pair", gpumesh(bob, "pair-code").stdout.strip()).returncode == 0
    # alice moves to another port: the address in her pairing code is stale now
    new_port = _free_udp_port()
    assert gpumesh(alice, "config", "set", "listen_port", str(new_port)).returncode == 0
    share = _start_share(alice)
    try:
        deadline = time.monotonic() + 15
        while "registered" not in json.loads(gpumesh(alice, "status", "--json").stdout).get(
            "relay_state", ""
        ):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        result = gpumesh(bob, "connect", "alice-pc", "--json")
        assert result.returncode == 0, result.stderr
        path = json.loads(result.stdout)["path"]
        # reached through the relay, then punched straight to where she listens now
        assert path == f"direct (hole-punched) 127.0.0.1:{new_port}"
        [peer] = json.loads(gpumesh(bob, "peers", "--json").stdout)
        assert peer["last_address"] == f"127.0.0.1:{new_port}"
        # A new dial (--fresh, not the warm session bob's node process kept) reaches
        # her new port again: bob's node process remembers that her last session came
        # through the relay, so it starts there and punches (docs/architecture.md).
        result = gpumesh(bob, "connect", "alice-pc", "--json", "--fresh")
        assert json.loads(result.stdout)["path"] == f"direct (hole-punched) 127.0.0.1:{new_port}"
        status = json.loads(gpumesh(alice, "status", "--json").stdout)
        assert status["relay_state"].startswith("registered as 127.0.0.1:")
    finally:
        _stop(share)


def test_the_provider_declines_relayed_sessions_from_nodes_it_did_not_pair(
    tmp_path: Path, relay: str
) -> None:
    alice, mallory = tmp_path / "a", tmp_path / "m"
    _init(alice, "alice-pc", _free_udp_port())
    _init(mallory, "mallory")
    for home in (alice, mallory):
        assert gpumesh(home, "config", "set", "relay", relay).returncode == 0
    code = gpumesh(alice, "pair-code").stdout.strip()
    assert gpumesh(mallory, "pair", code).returncode == 0  # one-sided: alice never paired back
    # make the direct address useless so only the relay can answer
    assert gpumesh(alice, "config", "set", "listen_port", str(_free_udp_port())).returncode == 0
    share = _start_share(alice)
    try:
        time.sleep(1.0)  # let alice register
        result = gpumesh(mallory, "connect", "alice-pc", "--timeout", "4")
        _one_line_error(result, 4, "peer-declined")
    finally:
        _stop(share)


def test_a_copy_over_a_relay_found_session_arrives_whole_with_parity_on(
    tmp_path: Path, relay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Parity from the start: every QUIC datagram after the identity proof travels
    # as an FEC frame, through the relay and then the punched path; a frame routed
    # wrong anywhere would stall the copy.
    monkeypatch.setenv("GPUMESH_FEC", "on")
    alice, bob = tmp_path / "a", tmp_path / "b"
    _init(alice, "alice-pc", _free_udp_port())
    _init(bob, "bob-laptop")
    for home in (alice, bob):
        assert gpumesh(home, "config", "set", "relay", relay).returncode == 0
    assert gpumesh(bob, "pair", gpumesh(alice, "pair-code").stdout.strip()).returncode == 0
    assert gpumesh(alice, "pair", gpumesh(bob, "pair-code").stdout.strip()).returncode == 0
    # alice's pairing code names a stale port: only the relay finds her
    assert gpumesh(alice, "config", "set", "listen_port", str(_free_udp_port())).returncode == 0
    source = tmp_path / "big.bin"
    source.write_bytes(os.urandom(3 * 1024 * 1024 + 17))
    back = tmp_path / "back.bin"
    share = _start_share(alice)
    try:
        deadline = time.monotonic() + 15
        while "registered" not in json.loads(gpumesh(alice, "status", "--json").stdout).get(
            "relay_state", ""
        ):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        up = gpumesh(bob, "cp", "--no-fast-path", str(source), "alice-pc:/big.bin", "--json")
        assert up.returncode == 0, up.stderr
        down = gpumesh(bob, "cp", "--no-fast-path", "alice-pc:/big.bin", str(back), "--json")
        assert down.returncode == 0, down.stderr
        assert back.read_bytes() == source.read_bytes()
    finally:
        _stop(share)


def test_a_peer_not_sharing_is_said_on_each_path_tried(tmp_path: Path, relay: str) -> None:
    # Before, with a relay, the relay's refusal alone was said (unknown-peer), and
    # that nothing listened at the peer's own address was lost.
    alice, bob = tmp_path / "a", tmp_path / "b"
    port = _free_udp_port()
    _init(alice, "alice-pc", port)
    _init(bob, "bob-laptop")
    for home in (alice, bob):
        assert gpumesh(home, "config", "set", "relay", relay).returncode == 0
    assert gpumesh(bob, "pair", gpumesh(alice, "pair-code").stdout.strip()).returncode == 0
    _one_line_error(
        gpumesh(bob, "connect", "alice-pc", "--timeout", "10"),
        4,
        f"cannot reach alice-pc directly (nothing is listening on 127.0.0.1:{port} "
        f"(connection refused)) nor through the relay {relay} (unknown-peer: the peer is "
        "not registered with the relay): is `gpumesh share` running on alice-pc?",
    )
