"""`gpumesh desktop` as users type it: a real `gpumesh share` process, the real CLI
for the owner's commands and for `desktop connect`, and a small RFB-speaking TCP
server standing in for the VNC server (test_desktop_vnc.py runs a real one)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import gpumesh
from tests.integration.node import cli
from tests.integration.test_cli import _free_udp_port, _init, _one_line_error, _start_share

pytestmark = pytest.mark.usefixtures("gpumesh_processes")

CEILING = 20.0


class _Greeter(socketserver.BaseRequestHandler):
    """Says what a VNC server says first, then echoes."""

    def handle(self) -> None:
        self.request.sendall(b"RFB 003.008\n")
        while data := self.request.recv(65536):
            self.request.sendall(data)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture
def vnc_like() -> Iterator[int]:
    server = _Server(("127.0.0.1", 0), _Greeter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


@pytest.fixture
def homes(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    alice, bob = tmp_path / "a", tmp_path / "b"
    _init(alice, "alice-pc", _free_udp_port())
    _init(bob, "bob-laptop")
    share = _start_share(alice)
    try:
        assert gpumesh(bob, "pair", gpumesh(alice, "pair-code").stdout.strip()).returncode == 0
        assert gpumesh(alice, "pair", gpumesh(bob, "pair-code").stdout.strip()).returncode == 0
        yield alice, bob
    finally:
        share.send_signal(signal.SIGINT)
        share.wait(timeout=15)
        for pipe in (share.stdout, share.stderr):
            if pipe is not None:
                pipe.close()


def _connect(bob: Path) -> tuple[subprocess.Popen[str], int]:
    """`desktop connect alice-pc` on a free loopback port; returns it and the port."""
    command = ["desktop", "connect", "alice-pc", "--bind", "127.0.0.1:0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpumesh", *command],
        env=dict(os.environ, GPUMESH_HOME=str(bob)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    found = re.search(r"is on 127\.0\.0\.1:(\d+);", first)
    if found is None:
        proc.kill()
        raise AssertionError((first, proc.communicate()))
    return proc, int(found.group(1))


def test_owner_commands_and_a_session_cut_by_desktop_deny(
    homes: tuple[Path, Path], vnc_like: int
) -> None:
    alice, bob = homes
    shared = gpumesh(alice, "desktop", "share", "--vnc", "--port", str(vnc_like))
    assert shared.returncode == 0, shared.stderr
    assert f"vnc on 127.0.0.1:{vnc_like}" in shared.stdout
    assert "Nobody may use it yet" in shared.stdout

    report = json.loads(gpumesh(alice, "desktop", "doctor", "--json").stdout)
    # Found in the kernel's table (Linux): not connected to, so no greeting read.
    assert {"kind": "vnc", "port": vnc_like, "greeting": None, "exposed": []} in report["servers"]
    assert (report["shared"], report["share_port"], report["share_answers"]) == (
        True,
        vnc_like,
        True,
    )
    assert (report["sharing"], report["allowed"], report["connected"]) == (True, [], [])

    # Not on the desktop allowlist, though allowed to run jobs: one line, exit 3.
    refused = gpumesh(bob, "desktop", "connect", "alice-pc", "--bind", "127.0.0.1:0")
    _one_line_error(refused, 3, "alice-pc has not allowed you to use its desktop")

    assert gpumesh(alice, "desktop", "allow", "bob-laptop").returncode == 0
    proc, port = _connect(bob)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=CEILING) as conn:
            assert conn.recv(12) == b"RFB 003.008\n"
            conn.sendall(b"ping")
            assert conn.recv(4) == b"ping"
            status = gpumesh(alice, "status").stdout
            assert re.search(r"Desktop  bob-laptop connected \(vnc\) since \d\d:\d\d", status)
            denied = gpumesh(alice, "desktop", "deny", "bob-laptop")
            assert denied.returncode == 0, denied.stderr
            # The open connection is cut by the deny itself, with no traffic from us.
            assert conn.recv(100) == b""
        _, err = proc.communicate(timeout=CEILING)
        assert proc.returncode == 3
        lines = err.strip().splitlines()
        assert lines[-1] == "error: alice-pc has revoked your access to its desktop"
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    report = json.loads(gpumesh(alice, "desktop", "doctor", "--json").stdout)
    assert report["allowed"] == [] and report["connected"] == []

    stopped = gpumesh(alice, "desktop", "share", "stop")
    assert stopped.returncode == 0 and "no longer shared" in stopped.stdout
    assert gpumesh(alice, "desktop", "allow", "bob-laptop").returncode == 0
    # No PEER: $GPUMESH_PEER's, as wherever a peer is taken.
    unshared = cli(bob, "desktop", "connect", "--bind", "127.0.0.1:0", GPUMESH_PEER="alice-pc")
    _one_line_error(unshared, 2, "alice-pc does not share its desktop")


def test_connect_refuses_a_non_loopback_bind(homes: tuple[Path, Path]) -> None:
    _alice, bob = homes
    result = gpumesh(bob, "desktop", "connect", "alice-pc", "--bind", "0.0.0.0:15900")
    _one_line_error(result, 2, "listens on a loopback address only")


def test_ctrl_c_closes_the_tunnel(homes: tuple[Path, Path], vnc_like: int) -> None:
    alice, bob = homes
    assert gpumesh(alice, "desktop", "share", "--port", str(vnc_like)).returncode == 0
    assert gpumesh(alice, "desktop", "allow", "bob-laptop").returncode == 0
    proc, port = _connect(bob)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=CEILING)
    assert proc.returncode == 0, err
    assert "Tunnel closed." in err
    deadline = time.monotonic() + CEILING
    while True:  # the port is free again (the listener is gone)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except ConnectionRefusedError:
            break
        assert time.monotonic() < deadline
        time.sleep(0.1)


def _connect_json(bob: Path) -> tuple[subprocess.Popen[str], dict[str, object]]:
    """`desktop connect alice-pc --json` on a free port; returns it and what it printed first."""
    command = ["desktop", "connect", "alice-pc", "--bind", "127.0.0.1:0", "--json"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpumesh", *command],
        env=dict(os.environ, GPUMESH_HOME=str(bob)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    lines = [proc.stdout.readline()]
    while lines[-1] and lines[-1].rstrip() != "}":  # the first document is indented
        lines.append(proc.stdout.readline())
    try:
        return proc, json.loads("".join(lines))
    except ValueError:
        proc.kill()
        raise AssertionError((lines, proc.communicate())) from None


@pytest.mark.parametrize("data_channel", ["on", "off"])
def test_connect_json_says_what_carries_each_connection(
    homes: tuple[Path, Path], vnc_like: int, data_channel: str
) -> None:
    """After where it listens, one line per connection as it opens: a data channel on
    this direct loopback link, QUIC when the consumer turned data channels off."""
    alice, bob = homes
    assert gpumesh(alice, "desktop", "share", "--port", str(vnc_like)).returncode == 0
    assert gpumesh(alice, "desktop", "allow", "bob-laptop").returncode == 0
    assert gpumesh(bob, "config", "set", "data_channel", data_channel).returncode == 0
    proc, ready = _connect_json(bob)
    try:
        assert ready["provider"] == "alice-pc"
        listen = str(ready["listen"])
        port = int(listen.rsplit(":", 1)[1])
        path = "channel" if data_channel == "on" else "quic"
        assert proc.stdout is not None
        for number in (1, 2):
            with socket.create_connection(("127.0.0.1", port), timeout=CEILING) as conn:
                conn.settimeout(CEILING)
                assert conn.recv(12) == b"RFB 003.008\n"  # carried both ways
                assert json.loads(proc.stdout.readline()) == {"connection": number, "path": path}
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=CEILING)
