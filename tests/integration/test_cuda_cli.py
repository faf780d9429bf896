"""``gpumesh cuda`` as users run it: a real `gpumesh share` process, the CLI in
subprocesses, the bridge on loopback TCP and a unix socket. No GPU here: the
provider runs the host-memory fallback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumesh.cuda import RemoteDevice
from gpumesh.cuda.ops import demo
from gpumesh.errors import AccessDeniedError
from gpumesh.transport.sockowner import connection_owner, socket_owner
from tests.integration.conftest import gpumesh
from tests.integration.test_cli import _free_udp_port, _init, _one_line_error, _start_share


@pytest.fixture
def homes(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """alice-pc shares (CUDA not yet), bob-laptop is paired with her both ways."""
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
        share.communicate(timeout=15)


def _bridge(bob: Path, bind: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpumesh", "cuda", "bridge", "--peer", "alice-pc", "--bind", bind],
        env=dict(os.environ, GPUMESH_HOME=str(bob)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()
    assert line.startswith("CUDA bridge to alice-pc on "), line + proc.stderr.read()
    return proc, line.split(" on ", 1)[1].split(" (", 1)[0]


def test_share_allow_demo_bench_and_deny_from_the_cli(homes: tuple[Path, Path]) -> None:
    alice, bob = homes
    _one_line_error(
        gpumesh(bob, "cuda", "demo", "--peer", "alice-pc"), 3, "alice-pc does not share CUDA"
    )
    shared = gpumesh(alice, "cuda", "share")
    assert shared.stdout == "CUDA sessions are offered now and whenever this node shares\n"
    _one_line_error(
        gpumesh(bob, "cuda", "demo", "--peer", "alice-pc"),
        3,
        "alice-pc has not allowed you CUDA sessions: ask its owner to run "
        "`gpumesh cuda allow bob-laptop`",
    )
    assert gpumesh(alice, "cuda", "allow", "bob-laptop").stdout == (
        "bob-laptop may open CUDA sessions here\n"
    )
    doctor = gpumesh(alice, "cuda", "doctor").stdout
    assert "host-memory fallback: " in doctor
    assert "Shared   yes" in doctor and "Allowed  bob-laptop" in doctor

    ran = gpumesh(bob, "cuda", "demo", "--peer", "alice-pc")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith(
        "vector add of 1,048,576 floats on alice-pc: correct, ran on the host-memory fallback "
        "(the provider has no NVIDIA GPU), "
    )
    measured = gpumesh(bob, "cuda", "bench", "--peer", "alice-pc", "--memory", "20MiB", timeout=120)
    assert measured.returncode == 0, measured.stderr
    lines = measured.stdout.splitlines()
    assert lines[0] == "CUDA on alice-pc (host-memory fallback)"
    assert lines[1].startswith("call latency  p50 ") and "link ping" in lines[1]
    assert [line.split()[0] for line in lines[5:]] == ["1", "4", "16", "64", "256"]
    assert "MB/s" in lines[6] and "skipped" not in lines[7]
    assert "skipped: over the session's memory" in lines[8]

    assert gpumesh(alice, "cuda", "deny", "bob-laptop").returncode == 0
    _one_line_error(gpumesh(bob, "cuda", "demo", "--peer", "alice-pc"), 3, "not allowed you CUDA")
    assert gpumesh(alice, "cuda", "share", "stop").returncode == 0
    assert "Shared   no" in gpumesh(alice, "cuda", "doctor").stdout


def test_the_bridge_serves_local_programs_and_ends_on_deny(
    homes: tuple[Path, Path], tmp_path: Path
) -> None:
    alice, bob = homes
    assert gpumesh(alice, "cuda", "share").returncode == 0
    for bind in ("127.0.0.1:0", f"unix:{tmp_path / 'cuda.sock'}"):
        assert gpumesh(alice, "cuda", "allow", "bob-laptop").returncode == 0
        proc, where = _bridge(bob, bind)
        try:
            with RemoteDevice.bridge(where) as device:
                assert device.backend == "fallback"
                assert demo(device, elements=50_000).correct
                if where.startswith("unix:"):
                    assert os.stat(where[5:]).st_mode & 0o777 == 0o600
                status = gpumesh(alice, "status").stdout
                assert "CUDA     bob-laptop: 1.1GB on host-memory fallback (pid " in status
                assert gpumesh(alice, "cuda", "deny", "bob-laptop").returncode == 0
                revoked = "alice-pc has revoked your CUDA access"
                with pytest.raises(AccessDeniedError, match=revoked):
                    for _ in range(100_000):  # the deny lands between two calls
                        device.device_count()
        finally:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=15)


def test_the_bridge_refuses_other_addresses_and_knows_who_connects(tmp_path: Path) -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        with client, accepted:
            owner = connection_owner(accepted)
            assert socket_owner(accepted.getpeername(), accepted.getsockname()) == owner
    assert owner == os.getuid()
