"""``gpumesh cuda`` as users run it: a real `gpumesh share` process, the CLI in
subprocesses, the bridge on loopback TCP and a unix socket. No GPU here: the
provider runs the host-memory fallback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumesh.client.cuda import demo
from gpumesh.cuda import RemoteDevice
from gpumesh.errors import AccessDeniedError
from gpumesh.transport.sockowner import connection_owner, socket_owner
from tests.integration.conftest import gpumesh
from tests.integration.node import cli, wait_shares
from tests.integration.test_cli import _free_udp_port, _init, _one_line_error, _start_share
from tests.integration.test_least_privilege import (
    Unprivileged,
    _sharing,
    _wait_for_agent,
    unprivileged,  # noqa: F401 (a fixture)
)

pytestmark = pytest.mark.usefixtures("gpumesh_processes")


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
    report = json.loads(gpumesh(alice, "cuda", "doctor", "--json").stdout)
    assert (report["backend"], report["sharing"], report["allowed"]) == (
        "fallback",
        True,
        ["bob-laptop"],
    )
    assert report["devices"] == [] and report["sessions"] == []

    ran = cli(bob, "cuda", "demo", GPUMESH_PEER="alice-pc")  # the peer, as everywhere
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith(
        "vector add of 1,048,576 floats on alice-pc: correct, ran on the host-memory fallback "
        "(the provider has no NVIDIA GPU), "
    )
    # --gpu-memory, as run names it; --memory (its first name) stays an alias.
    zero = gpumesh(bob, "cuda", "demo", "--peer", "alice-pc", "--memory", "0")
    _one_line_error(zero, 2, "--gpu-memory '0' must be a size above zero, such as 2GB")
    measured = gpumesh(
        bob, "cuda", "bench", "--peer", "alice-pc", "--gpu-memory", "20MiB", timeout=120
    )
    assert measured.returncode == 0, measured.stderr
    lines = measured.stdout.splitlines()
    assert lines[0] == "CUDA on alice-pc (host-memory fallback)"
    assert lines[1].startswith("call latency  p50 ") and "link ping" in lines[1]
    assert [line.split()[0] for line in lines[5:]] == ["1", "4", "16", "64", "256"]
    assert "MB/s" in lines[6] and "skipped" not in lines[7]
    assert "skipped: over the session's memory" in lines[8]
    small = ("--gpu-memory", "3MiB", "--json")
    measured = gpumesh(bob, "cuda", "bench", "--peer", "alice-pc", *small, timeout=120)
    assert measured.returncode == 0, measured.stderr
    result = json.loads(measured.stdout)
    mib = 1024 * 1024
    assert [row["size"] for row in result["rows"]] == [mib]
    assert result["skipped"] == [4 * mib, 16 * mib, 64 * mib, 256 * mib]
    assert result["backend"] == "fallback" and result["link_rtt_ms"] > 0
    assert result["rows"][0]["htod_mb_s"] > 0 and result["link_mb_per_s"] > 0

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


def test_an_agent_that_is_not_root_runs_workers_as_itself_and_says_so(
    unprivileged: Unprivileged,  # noqa: F811 (the fixture, imported above)
    tmp_path: Path,
) -> None:
    """A real `gpumesh share` as an ordinary user (in the docker group), which cannot
    switch users: its workers run as it, still without new privileges or its
    environment, and `cuda share`, `cuda doctor` and `doctor` say so in one line."""
    alice, user = unprivileged.mounts / "homes" / "alice", unprivileged
    for args in (
        ("init", "--name", "alice-pc"),
        ("config", "set", "listen_host", "127.0.0.1"),
        ("config", "set", "listen_port", str(_free_udp_port())),
        # An agent that is not root cannot install the job network's rules.
        ("config", "set", "job_network", "bridge"),
    ):
        assert user.run(alice, *args).returncode == 0
    bob = tmp_path / "bob"
    _init(bob, "bob-laptop")
    note = (
        f"CUDA workers run as the agent's own user (uid {user.uid}, with its groups), not as "
        "job_user: only an agent started as root can switch them to it"
    )
    with _sharing(user.command("share"), user.env(alice)) as agent:
        _wait_for_agent(alice, agent)
        assert gpumesh(bob, "pair", user.run(alice, "pair-code").stdout.strip()).returncode == 0
        assert user.run(alice, "pair", gpumesh(bob, "pair-code").stdout.strip()).returncode == 0
        shared = user.run(alice, "cuda", "share")
        assert shared.stdout.splitlines() == [
            "CUDA sessions are offered now and whenever this node shares",
            note,
        ]
        assert user.run(alice, "cuda", "allow", "bob-laptop").returncode == 0
        assert f"Worker   {note}\n" in user.run(alice, "cuda", "doctor").stdout
        checks = json.loads(user.run(alice, "doctor", "--json").stdout)
        [worker] = [check for check in checks if check["name"] == "cuda worker"]
        assert (worker["status"], worker["detail"]) == ("ok", note)

        with RemoteDevice("alice-pc", home=bob, memory=1 << 20) as dev:
            assert dev.device_count() == 1  # it found its code as the agent did
            sessions = wait_shares(alice)["agent"]["cuda"]
            status = (Path("/proc") / str(sessions[0]["pid"]) / "status").read_text()
            fields = dict(line.split(":\t", 1) for line in status.splitlines())
            assert fields["Uid"].split() == [str(user.uid)] * 4
            assert fields["NoNewPrivs"] == "1"
            environ = (Path("/proc") / str(sessions[0]["pid"]) / "environ").read_bytes()
            assert b"GPUMESH_HOME" not in environ
