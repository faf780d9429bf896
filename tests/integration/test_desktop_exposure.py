"""`desktop share` and `desktop doctor` warn about a server that listens beyond loopback.

A VNC or RDP server on 0.0.0.0 (x11vnc's and xrdp's default) is reached by
every job's container through its gateway and by the LAN, whatever GPUMesh's
desktop allowlist says. The servers here are real listening sockets on free
ports; the CLI reads them from the kernel's socket table.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumesh.transport.sockowner import owner_check_available
from tests.integration.conftest import gpumesh
from tests.integration.test_cli import _init

pytestmark = pytest.mark.usefixtures("gpumesh_processes")


@pytest.fixture
def home(tmp_path: Path) -> Path:
    if not owner_check_available():
        pytest.skip("needs the kernel's socket table (Linux)")
    home = tmp_path / "a"
    _init(home, "alice-pc")
    return home


def _server(address: str) -> Iterator[int]:
    with socket.socket() as server:
        server.bind((address, 0))
        server.listen(1)
        yield int(server.getsockname()[1])


@pytest.fixture
def everywhere() -> Iterator[int]:
    yield from _server("0.0.0.0")


@pytest.fixture
def loopback_only() -> Iterator[int]:
    yield from _server("127.0.0.1")


def test_a_server_on_every_address_is_warned_about(home: Path, everywhere: int) -> None:
    shared = gpumesh(home, "desktop", "share", "--vnc", "--port", str(everywhere))
    assert shared.returncode == 0, shared.stderr
    warning = [line for line in shared.stderr.splitlines() if line.startswith("WARNING:")]
    assert len(warning) == 1, shared.stderr
    assert f"port {everywhere} also listens on every address" in warning[0]
    assert "jobs in containers" in warning[0] and "127.0.0.1 only" in warning[0]

    doctor = gpumesh(home, "desktop", "doctor")
    assert doctor.returncode == 0, doctor.stderr
    lines = doctor.stdout.splitlines()
    listed = next(i for i, line in enumerate(lines) if f"127.0.0.1:{everywhere}" in line)
    assert lines[listed + 1].startswith("!!")
    assert "also listens on every address" in lines[listed + 1]

    as_json = json.loads(gpumesh(home, "desktop", "doctor", "--json").stdout)
    (server,) = [s for s in as_json["servers"] if s["port"] == everywhere]
    assert server["exposed"] == ["0.0.0.0"]


def test_a_loopback_only_server_is_not_warned_about(home: Path, loopback_only: int) -> None:
    shared = gpumesh(home, "desktop", "share", "--vnc", "--port", str(loopback_only))
    assert shared.returncode == 0, shared.stderr
    assert "WARNING" not in shared.stderr
    doctor = gpumesh(home, "desktop", "doctor")
    assert "also listens on" not in doctor.stdout
    as_json = json.loads(gpumesh(home, "desktop", "doctor", "--json").stdout)
    (server,) = [s for s in as_json["servers"] if s["port"] == loopback_only]
    assert server["exposed"] == []
