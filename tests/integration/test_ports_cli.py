"""`run --port` and `gpumesh port` as users type them: a real `gpumesh share` process,
the real CLI through bob's node process, a busybox httpd and nc in the job's
container, and the one-line refusals of bad input."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import gpumesh, remove_containers
from tests.integration.test_cli import _free_udp_port, _init, _one_line_error, _start_share

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")

CEILING = 30.0
IMAGE = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")
WEB = "mkdir -p /tmp/www && echo hello-from-the-job > /tmp/www/index.html && "
"""The start of a job that serves a page with busybox httpd."""


@pytest.fixture
def homes(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    alice, bob = tmp_path / "a", tmp_path / "b"
    _init(alice, "alice-pc", _free_udp_port())
    _init(bob, "bob-laptop")
    assert gpumesh(bob, "config", "set", "image", IMAGE).returncode == 0
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
        node_id = json.loads(gpumesh(alice, "status", "--json", "--offline").stdout)["node_id"]
        remove_containers(node_id)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _spawn(home: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "gpumesh", *args],
        env=dict(os.environ, GPUMESH_HOME=str(home)),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _line_with(pipe: object, pattern: str, seen: list[str]) -> re.Match[str]:
    """Read lines of ``pipe`` until one matches ``pattern`` (the process's end fails)."""
    assert hasattr(pipe, "readline")
    while True:
        line = pipe.readline()
        seen.append(line)
        assert line, f"ended before {pattern!r}: {seen}"
        found = re.search(pattern, line)
        if found is not None:
            return found


def _get(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=CEILING) as sock:
        sock.sendall(b"GET / HTTP/1.0\r\nHost: localhost\r\n\r\n")
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_run_port_prints_the_urls_and_serves_until_the_job_ends(
    homes: tuple[Path, Path],
) -> None:
    _alice, bob = homes
    web, talk = _free_port(), _free_port()
    script = (
        WEB + "busybox httpd -p 8000 -h /tmp/www; busybox nc -ll -p 9000 -e /bin/cat & "
        "echo serving; sleep 300"
    )
    run = _spawn(
        bob, "run", "--peer", "alice-pc", "--port", f"{web}:8000", "-p", f"{talk}:9000",
        "--", "sh", "-c", script,
    )  # fmt: skip
    seen: list[str] = []
    try:
        urls = {
            _line_with(run.stderr, r"(http://127\.0\.0\.1:\d+) reaches port (\d+)", seen).group(2)
            for _ in range(2)
        }
        assert urls == {"8000", "9000"}
        assert b"hello-from-the-job" in _get(web)
        with socket.create_connection(("127.0.0.1", talk), timeout=CEILING) as sock:
            for line in (b"GET /ws HTTP/1.1\r\nUpgrade: websocket\r\n\r\n", b"\x81\x02hi"):
                sock.sendall(line)
                got = b""
                while len(got) < len(line):
                    got += sock.recv(1024)
                assert got == line
        (job,) = json.loads(gpumesh(bob, "jobs", "--json").stdout)
        assert gpumesh(bob, "cancel", job["job_id"]).returncode == 0
        out, err = run.communicate(timeout=CEILING)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert "serving" in out
    assert "Traceback" not in err, err
    with pytest.raises(OSError):  # the job ended: the forward with it
        socket.create_connection(("127.0.0.1", web), timeout=5).close()


def test_port_attaches_to_a_running_job_until_ctrl_c(homes: tuple[Path, Path]) -> None:
    _alice, bob = homes
    started = gpumesh(
        bob, "run", "--peer", "alice-pc", "--detach", "--", "sh", "-c",
        WEB + "busybox httpd -f -p 8000 -h /tmp/www",
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    job_id = started.stdout.strip()
    local = _free_port()
    port = _spawn(bob, "port", job_id[:8], f"{local}:8000", "8888")
    seen: list[str] = []
    try:
        first = _line_with(port.stdout, rf"127\.0\.0\.1:{local} -> port 8000 of job", seen)
        assert job_id in first.string
        _line_with(port.stderr, rf"http://127\.0\.0\.1:{local} reaches port 8000", seen)
        assert b"hello-from-the-job" in _get(local)
        # 8888: nothing listens there in the job; the connection closes, one line says so.
        with socket.create_connection(("127.0.0.1", 8888), timeout=CEILING) as sock:
            sock.settimeout(CEILING)
            assert sock.recv(100) == b""
        _line_with(port.stderr, rf"nothing listens on 8888 in job {job_id} yet", seen)
        port.send_signal(signal.SIGINT)
        _out, err = port.communicate(timeout=CEILING)
    finally:
        if port.poll() is None:
            port.kill()
            port.communicate()
    assert "Forwarding ended." in err and "Traceback" not in err
    deadline = time.monotonic() + CEILING
    while True:  # the port is free again (the listener is gone)
        try:
            socket.create_connection(("127.0.0.1", local), timeout=1).close()
        except ConnectionRefusedError:
            break
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert gpumesh(bob, "cancel", job_id).returncode == 0
    _one_line_error(gpumesh(bob, "port", job_id, "8000"), 2, "has ended")


def test_bad_ports_are_one_line_each(homes: tuple[Path, Path]) -> None:
    _alice, bob = homes
    for bad, says in (("0", "0 is not a port"), ("70000", "70000 is not"), ("a:b", "'a' is not")):
        run = gpumesh(bob, "run", "--peer", "alice-pc", "--port", bad, "--", "true")
        _one_line_error(run, 2, says)
        _one_line_error(gpumesh(bob, "port", "abcdef12", bad), 2, says)
    run = gpumesh(bob, "run", "--peer", "alice-pc", "--detach", "--port", "8000", "--", "true")
    _one_line_error(run, 2, "--port needs `run` to follow the job")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        busy = taken.getsockname()[1]
        run = gpumesh(bob, "run", "--peer", "alice-pc", "--port", f"{busy}:80", "--", "true")
        assert run.returncode != 0 and f"127.0.0.1:{busy}" in run.stderr
        _one_line_error(run, run.returncode, f"cannot listen on 127.0.0.1:{busy}")
    _one_line_error(gpumesh(bob, "port", "abcdef12", "8000"), 2, "abcdef12")
