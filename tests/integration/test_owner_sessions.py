"""The owner's view of open sessions, and ending one: a real `gpumesh share`
process, a real `gpumesh-control` in front of it, and real consumers of each kind
(a shell in a container of the real dockerd, a desktop connection to a plain TCP
echo server standing in for the shared desktop, a CUDA session on the host-memory
fallback, as these machines have no GPU)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import socketserver
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpumesh.cuda import RemoteDevice
from gpumesh.errors import AccessDeniedError
from tests.integration.conftest import gpumesh, shared_pair, until
from tests.integration.test_control_api import Api, start_control
from tests.integration.test_exec import _gone, _shells

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")

CEILING = 30.0
"""Generous bound for anything that should be quick (the CI box is loaded)."""
MiB = 1024 * 1024


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@dataclass
class Owner:
    alice: Path
    bob: Path
    api: Api
    """alice's control API (alice shares)."""
    alice_id: str


@contextlib.contextmanager
def sharing_sessions(root: Path) -> Iterator[Owner]:
    """alice (under ``root``) shares a desktop (an echo server) and CUDA with
    bob-laptop, and serves her control API; also the browser tests' set-up."""
    desktop = _Server(("127.0.0.1", 0), _Echo)
    threading.Thread(target=desktop.serve_forever, daemon=True).start()
    with shared_pair(root) as (alice, bob):
        for args in (
            ("desktop", "share", "--port", str(desktop.server_address[1])),
            ("desktop", "allow", "bob-laptop"),
            ("cuda", "share"),
            ("cuda", "allow", "bob-laptop"),
        ):
            done = gpumesh(alice, *args)
            assert done.returncode == 0, (args, done.stderr)
        api = start_control(alice)
        try:
            alice_id = json.loads(gpumesh(alice, "status", "--json").stdout)["node_id"]
            yield Owner(alice, bob, api, alice_id)
        finally:
            api.stop()
            desktop.shutdown()
            desktop.server_close()


@pytest.fixture(scope="module")
def owner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Owner]:
    with sharing_sessions(tmp_path_factory.mktemp("owner")) as shared:
        yield shared


def _listed(owner: Owner, kind: str) -> list[dict[str, Any]]:
    """The open sessions of ``kind`` as the API's owner view lists them, and check
    that `status --json` lists the same."""
    view = owner.api.ok("GET", "/api/v1/owner")["sessions"][kind]
    status = json.loads(gpumesh(owner.alice, "status", "--json", "--offline").stdout)
    assert status["sessions"][kind] == view
    return list(view)


def _stop(owner: Owner, route: str, session_id: str) -> dict[str, Any]:
    """End one through the API over TCP, with the bearer token."""
    response = owner.api.tcp("POST", f"/api/v1/owner/{route}/{session_id}/stop")
    assert response.status_code == 200, response.text
    ended: dict[str, Any] = response.json()
    return ended


def test_an_open_shell_is_listed_and_ended_by_the_owner(owner: Owner, engine) -> None:
    shell = subprocess.Popen(
        [sys.executable, "-m", "gpumesh", "exec", "alice-pc", "--", "sh", "-c",
         "echo ready; sleep 600"],
        env=dict(os.environ, GPUMESH_HOME=str(owner.bob)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert shell.stdout is not None
        assert shell.stdout.readline() == "ready\n"
        [listed] = until(lambda: _listed(owner, "shells"), "the shell listed", within=CEILING)
        assert listed["peer"] == "bob-laptop" and listed["id"].startswith("shell-")
        assert listed["image"] == os.environ.get(
            "GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1"
        )
        assert listed["container"].startswith("gpumesh-exec-") and listed["since"] > 0
        text = gpumesh(owner.alice, "status", "--offline").stdout
        assert re.search(rf"Shell    bob-laptop in \S+ since \d\d:\d\d \(id {listed['id']}\)", text)
        assert len(_shells(engine, owner.alice_id)) == 1

        ended = _stop(owner, "shells", listed["id"])
        assert ended == {"kind": "shell", "id": listed["id"], "peer": "bob-laptop"}
        _, err = shell.communicate(timeout=CEILING)
        assert shell.returncode == 3, err
        assert err.strip().splitlines() == ["error: alice-pc's owner ended your shell"]
        assert _gone(engine, owner.alice_id, within=CEILING)
        assert _listed(owner, "shells") == []
        # Once gone, it is not found: one line, 404.
        again = owner.api.tcp("POST", f"/api/v1/owner/shells/{listed['id']}/stop")
        assert again.status_code == 404 and "`gpumesh status` lists" in again.json()["message"]
    finally:
        if shell.poll() is None:
            shell.kill()
            shell.communicate()


def test_a_desktop_connection_is_listed_and_ended_by_the_owner(owner: Owner) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpumesh", "desktop", "connect", "alice-pc", "--bind",
         "127.0.0.1:0"],
        env=dict(os.environ, GPUMESH_HOME=str(owner.bob)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        found = re.search(r"is on 127\.0\.0\.1:(\d+);", first)
        assert found is not None, (first, proc.stderr)
        with socket.create_connection(("127.0.0.1", int(found.group(1))), CEILING) as conn:
            conn.sendall(b"ping")
            assert conn.recv(4) == b"ping"
            [listed] = until(
                lambda: _listed(owner, "desktops"), "the desktop listed", within=CEILING
            )
            assert (listed["peer"], listed["kind"]) == ("bob-laptop", "tcp")
            assert listed["id"].startswith("desktop-") and listed["port"] > 0
            # A shell's route does not end a desktop connection.
            wrong = owner.api.tcp("POST", f"/api/v1/owner/shells/{listed['id']}/stop")
            assert wrong.status_code == 404
            ended = _stop(owner, "desktop", listed["id"])
            assert ended == {"kind": "desktop", "id": listed["id"], "peer": "bob-laptop"}
            conn.settimeout(CEILING)
            assert conn.recv(100) == b""  # cut, with no traffic from us
        _, err = proc.communicate(timeout=CEILING)
        assert proc.returncode == 3, err
        assert err.strip().splitlines()[-1] == (
            "error: alice-pc's owner ended your desktop connection"
        )
        assert _listed(owner, "desktops") == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_a_cuda_session_is_listed_and_ended_by_the_owner(owner: Owner) -> None:
    dev = RemoteDevice("alice-pc", home=owner.bob, memory=2 * MiB)
    try:
        pointer = dev.alloc(MiB)
        dev.copy_to(pointer, b"x" * 16)
        [listed] = until(lambda: _listed(owner, "cuda"), "the CUDA session listed", within=CEILING)
        assert (listed["peer"], listed["memory"], listed["backend"]) == (
            "bob-laptop",
            2 * MiB,
            "fallback",
        )
        assert listed["id"].startswith("cuda-") and listed["pid"] > 0
        text = gpumesh(owner.alice, "status", "--offline").stdout
        assert f"id {listed['id']})" in text
        ended = _stop(owner, "cuda", listed["id"])
        assert ended == {"kind": "cuda", "id": listed["id"], "peer": "bob-laptop"}
        with pytest.raises(AccessDeniedError) as caught:
            dev.synchronize()
        assert str(caught.value) == "alice-pc's owner ended your CUDA session"
        assert _listed(owner, "cuda") == []
        with pytest.raises(OSError):
            os.kill(listed["pid"], 0)  # the worker is gone, and its memory with it
    finally:
        dev.close()


def test_the_owners_cancel_command_ends_a_session_by_its_id(owner: Owner) -> None:
    from tests.integration.test_cli import _one_line_error

    unknown = gpumesh(owner.alice, "cancel", "cuda-000000000000")
    _one_line_error(unknown, 2, "no open cuda session cuda-000000000000 on this node")
    dev = RemoteDevice("alice-pc", home=owner.bob, memory=MiB)
    try:
        [listed] = until(lambda: _listed(owner, "cuda"), "the CUDA session listed", within=CEILING)
        ended = gpumesh(owner.alice, "cancel", listed["id"])
        assert ended.returncode == 0, ended.stderr
        assert ended.stdout == f"Ended bob-laptop's CUDA session {listed['id']}\n"
        with pytest.raises(AccessDeniedError, match="owner ended your CUDA session"):
            dev.synchronize()
        assert _listed(owner, "cuda") == []
    finally:
        dev.close()


def test_through_the_node_process_the_owner_sees_and_ends_a_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """alice's `gpumesh share` is her home's node process: the agent and the control
    API in one process; `cancel` reaches the agent through that API."""
    from tests.integration.node import cli, status
    from tests.integration.test_cli import _one_line_error

    with shared_pair(tmp_path) as (alice, bob):
        assert status(alice)["node"]["sharing"] is True
        for args in (("cuda", "share"), ("cuda", "allow", "bob-laptop")):
            done = cli(alice, *args)
            assert done.returncode == 0, (args, done.stderr)
        dev = RemoteDevice("alice-pc", home=bob, memory=MiB)
        try:

            def listed() -> list[dict[str, Any]]:
                shown = json.loads(cli(alice, "status", "--json", "--offline").stdout)
                return list(shown["sessions"]["cuda"])

            [session] = until(listed, "the session listed", within=CEILING)
            unknown = cli(alice, "cancel", "shell-000000000000")
            _one_line_error(unknown, 2, "no open shell session shell-000000000000")
            ended = cli(alice, "cancel", session["id"])
            assert ended.returncode == 0, ended.stderr
            assert ended.stdout == f"Ended bob-laptop's CUDA session {session['id']}\n"
            with pytest.raises(AccessDeniedError, match="owner ended your CUDA session"):
                dev.synchronize()
            assert listed() == []
        finally:
            dev.close()
