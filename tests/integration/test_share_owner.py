"""Sharing owned by the node process: the share routes, `gpumesh share` as their
client (follow, detach, conflicts, Ctrl-C), `share stop`, `daemon run`, the idle
rule and how a share ended. Real node processes on real unix sockets, real QUIC
on loopback; the homes share with ``job_network none`` (no firewall rules to
install) and so need no root. No Docker is needed: nothing here runs a job."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from gpumesh.errors import ExitCode
from tests.integration.node import CEILING, alive, cli, spawn, status, wait_gone
from tests.integration.test_cli import _free_udp_port

pytestmark = pytest.mark.usefixtures("gpumesh_processes")


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("localhost", timeout=CEILING)
        self._path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(CEILING)
        self.sock.connect(self._path)


def _api(home: Path, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One request to ``home``'s node process, as any HTTP client sends it."""
    connection = _UnixConnection(home / "control.sock")
    try:
        payload = None if body is None else json.dumps(body).encode()
        connection.request(method, path, body=payload)
        answer = connection.getresponse()
        raw = answer.read()
        return answer.status, json.loads(raw) if raw else None
    finally:
        connection.close()


@pytest.fixture
def home(tmp_path: Path) -> Path:
    path = tmp_path / "home"
    assert cli(path, "init", "--name", "owner-box").returncode == 0
    settings = (
        ("listen_host", "127.0.0.1"),
        ("listen_port", str(_free_udp_port())),
        ("job_network", "none"),
    )
    for key, value in settings:
        assert cli(path, "config", "set", key, value).returncode == 0
    yield path
    cli(path, "daemon", "stop")


def _wait(check: Any, what: str) -> None:
    deadline = time.monotonic() + CEILING
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _one_line(result: subprocess.CompletedProcess[str], code: int, text: str) -> None:
    assert result.returncode == code, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and text in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_the_share_routes_start_read_and_stop_sharing(home: Path) -> None:
    assert cli(home, "jobs").returncode == 0  # a node process in the background
    code, view = _api(home, "GET", "/api/v1/share")
    assert code == 200 and view["sharing"] is False and view["options"] is None

    code, error = _api(home, "POST", "/api/v1/share", {"prot": 47001})
    assert code == 422 and "prot" in error["message"]
    code, error = _api(home, "POST", "/api/v1/share", {"port": 70000})
    assert code == 422 and "70000" in error["message"]
    code, error = _api(home, "POST", "/api/v1/share", {"max_vram": "lots"})
    assert code == 422 and "lots" in error["message"]
    assert _api(home, "GET", "/api/v1/share")[1]["sharing"] is False  # nothing started

    code, view = _api(home, "POST", "/api/v1/share", {})
    assert code == 200 and view["sharing"] is True, view
    assert view["options"]["port"] is None and view["udp"].startswith("127.0.0.1:")
    # The provider answers on that address (the same check a consumer's dial makes).
    assert json.loads(cli(home, "status", "--json").stdout)["sharing"] is True
    # The same options again join the share; others are refused in one line.
    assert _api(home, "POST", "/api/v1/share", {})[1]["since"] == view["since"]
    code, error = _api(home, "POST", "/api/v1/share", {"max_vram": "8GB"})
    assert code == 409 and "already shares with the defaults" in error["message"]

    code, ended = _api(home, "DELETE", "/api/v1/share")
    assert code == 200 and ended["sharing"] is False
    assert ended["ended"]["how"] == "stopped with `gpumesh share stop`"
    code, error = _api(home, "DELETE", "/api/v1/share")
    assert code == 404 and "does not share" in error["message"]


def test_share_detach_follow_conflict_and_stop(home: Path) -> None:
    detached = cli(home, "share", "--detach")
    assert detached.returncode == 0, detached.stderr
    assert "Sharing owner-box" in detached.stdout and "gpm1_" in detached.stdout
    node = status(home)["node"]
    assert node["sharing"] and node["detached"]

    # Other options: one line naming the running ones, exit 7.
    conflict = cli(home, "share", "--max-vram", "8GB")
    _one_line(conflict, ExitCode.IN_USE, "already shares with the defaults")

    # No options: it follows; Ctrl-C only stops following.
    with spawn(home, "share") as follower:
        _wait(lambda: "gpm1_" in _peek(home), "the share said no pairing code")
        _wait_for_line(follower, "Following this home's share")
        follower.send_signal(signal.SIGINT)
        out, err = follower.communicate(timeout=CEILING)
    assert follower.returncode == 0, err
    assert "Sharing owner-box" in out and "this home still shares" in err
    assert status(home)["node"]["sharing"]

    stopped = cli(home, "share", "stop")
    assert stopped.returncode == 0 and "Stopped sharing" in stopped.stdout
    assert not status(home)["node"]["sharing"]
    again = cli(home, "share", "stop")  # nothing to stop: what was asked for is so
    assert again.returncode == 0, again.stderr
    assert "No `gpumesh share` is running" in again.stdout and "nothing to stop" in again.stdout


def _peek(home: Path) -> str:
    """What the share has said so far (the output route without following)."""
    connection = _UnixConnection(home / "control.sock")
    try:
        connection.request("GET", "/api/v1/share/output?follow=false")
        return connection.getresponse().read().decode()
    finally:
        connection.close()


def _wait_for_line(process: subprocess.Popen[str], text: str) -> None:
    """Read ``process``'s stderr until a line holds ``text`` (it is set up by then)."""
    assert process.stderr is not None
    deadline = time.monotonic() + CEILING
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if text in line:
            return
        assert line, f"it ended before saying {text!r}"
    raise AssertionError(f"no line with {text!r}")


def test_ctrl_c_in_the_share_that_started_it_stops_sharing(home: Path) -> None:
    with spawn(home, "share") as share:
        _wait_for_line(share, "Press Ctrl-C")
        share.send_signal(signal.SIGINT)
        out, err = share.communicate(timeout=CEILING)
    assert share.returncode == 0, err
    assert "gpm1_" in out and "Stopped sharing." in err
    node = status(home)["node"]
    assert not node["sharing"] and node["share_ended"]["how"]


def test_a_sharing_node_process_is_not_idle_and_a_dead_one_does_not_share_again(
    home: Path,
) -> None:
    quick = {"GPUMESH_NODE_IDLE": "1"}
    detached = cli(home, "share", "--detach", **quick)
    assert detached.returncode == 0, detached.stderr
    pid = status(home)["node"]["pid"]
    with spawn(home, "share") as follower:
        _wait_for_line(follower, "Following this home's share")
        # Many idle limits pass: a share is unfinished work, the process stays.
        time.sleep(4)
        assert alive(pid)
        # Killed while sharing: the follower says so in one line and fails.
        os.kill(pid, signal.SIGKILL)
        _out, err = follower.communicate(timeout=CEILING)
    assert follower.returncode == ExitCode.FAILED
    assert f"the node process (pid {pid}) of {home} ended while sharing" in err
    assert "Traceback" not in err
    assert wait_gone(pid)
    told = cli(home, "daemon", "status").stdout
    assert "ended without stopping it (killed or crashed)" in told
    # The next node process does not share by itself, and says how the last one ended.
    assert cli(home, "jobs").returncode == 0
    node = status(home)["node"]
    assert node["pid"] != pid and not node["sharing"]
    assert "killed or crashed" in node["share_ended"]["how"]
    assert "killed or crashed" in cli(home, "status").stdout
    # Not sharing any more, an idle node process exits.
    stopped = cli(home, "daemon", "stop")
    assert stopped.returncode == 0
    quiet = cli(home, "jobs", **quick)
    assert quiet.returncode == 0
    idle_pid = status(home)["node"]["pid"]
    assert wait_gone(idle_pid)


def test_daemon_run_shares_in_the_foreground_and_stops_on_sigterm(home: Path) -> None:
    port = _free_udp_port()
    with spawn(home, "daemon", "run", "--port", str(port)) as run:
        _wait(lambda: (status(home)["node"] or {}).get("sharing"), "daemon run did not share")
        node = status(home)["node"]
        assert node["pid"] == run.pid and not node["detached"] and node["idle_exit"] is None
        _code, view = _api(home, "GET", "/api/v1/share")
        assert view["options"]["port"] == port and view["udp"] == f"127.0.0.1:{port}"
        # `sync` asks it to re-publish through the API (no signal).
        synced = cli(home, "config", "set", "rendezvous_url", "http://127.0.0.1:9")
        assert synced.returncode == 0
        republish = cli(home, "sync", "--no-dial")
        assert f"asked the node process (pid {run.pid})" in republish.stdout, republish
        run.send_signal(signal.SIGTERM)
        out, err = run.communicate(timeout=CEILING)
    assert run.returncode == 0, err
    assert "Sharing owner-box" in out and "Stopped sharing." in err
    said = cli(home, "daemon", "status").stdout
    assert "the node process got SIGTERM" in said


def test_daemon_run_on_a_taken_port_ends_with_one_line(home: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = str(taken.getsockname()[1])
        result = cli(home, "daemon", "run", "--port", port)
    assert result.returncode == ExitCode.IN_USE, result
    assert "cannot listen on UDP" in result.stderr and "Traceback" not in result.stderr


def test_a_foreground_node_process_takes_over_a_background_share(home: Path) -> None:
    detached = cli(home, "share", "--detach", "--max-vram", "8GB")
    assert detached.returncode == 0, detached.stderr
    background = status(home)["node"]["pid"]
    with spawn(home, "daemon", "run") as run:
        assert wait_gone(background)
        _wait(
            lambda: (
                (status(home)["node"] or {}).get("pid") == run.pid
                and status(home)["node"]["sharing"]
            ),
            "daemon run did not take the share over",
        )
        _code, view = _api(home, "GET", "/api/v1/share")
        assert view["options"]["max_vram"] == "8GB"  # the same options
        run.send_signal(signal.SIGINT)
        out, err = run.communicate(timeout=CEILING)
    assert run.returncode == 0, err
    assert "as the node process it took over did (--max-vram 8GB)" in out
    assert "Stopped sharing." in err
