"""Floods on the HTTP surfaces, for real: a `gpumesh-control` process (the node
process in the foreground) and a `gpumesh-registry` process on loopback, attacked
by another local user (``other_user``) or a stranger with `floodclient.py`.

Each server runs with a soft descriptor limit of 256 (its hard limit higher), the
request deadline shortened to 3 s and the token back-off to 0.5 s, so what the
guard must do shows in seconds: every wait below is a generous ceiling, never a
measured speed.
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import OtherUser
from tests.integration.conftest import gpumesh
from tests.integration.floodclient import send_body
from tests.integration.test_control_api import _free_tcp_port, started_lines

pytestmark = pytest.mark.usefixtures("gpumesh_processes")

CONTROL = str(Path(sys.executable).parent / "gpumesh-control")
FLOOD = str(Path(__file__).with_name("floodclient.py"))
PYTHON = "/usr/bin/python3"
"""A Python another user may run (the test's own may live in a private folder)."""
SOFT_FILES = 256
DEADLINE = 3.0
CEILING = 60.0
"""Seconds any one wait below may take on a loaded machine."""


def _few_files(*argv: str) -> list[str]:
    """``argv`` run with a soft descriptor limit of :data:`SOFT_FILES` (the hard one
    left as it is): 300 held connections used up such a limit before the guard,
    and the node process must lift it to the hard limit itself."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return ["prlimit", f"--nofile={SOFT_FILES}:{hard}", "--", *argv]


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, GPUMESH_HOME=str(home), GPUMESH_HTTP_DEADLINE=str(DEADLINE))
    env.pop("GPUMESH_API_TOKEN", None)
    env.pop("GPUMESH_LOG", None)
    env.update(extra)
    return env


@dataclass
class Control:
    home: Path
    proc: subprocess.Popen[str]
    port: int
    scheme: str = "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def token(self) -> str:
        return (self.home / "api.token").read_text().strip()

    def high_water(self) -> int:
        """The node process's peak resident memory (VmHWM), in bytes."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM")

    def unix(self) -> httpx.Client:
        return httpx.Client(
            transport=httpx.HTTPTransport(uds=str(self.home / "control.sock")),
            base_url="http://gpumesh",
            timeout=CEILING,
        )

    def stop(self) -> tuple[str, str]:
        if self.proc.poll() is None:
            self.proc.terminate()
        out, err = self.proc.communicate(timeout=CEILING)
        return out, err


def start_control(home: Path, *args: str, env: dict[str, str] | None = None) -> Control:
    port = _free_tcp_port()
    proc = subprocess.Popen(
        _few_files(CONTROL, "--listen", f"127.0.0.1:{port}", *args),
        env=env or _env(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = started_lines(proc)
    scheme = "https" if any("https://" in line for line in lines) else "http"
    return Control(home, proc, port, scheme)


@pytest.fixture(scope="module")
def control(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Control]:
    home = tmp_path_factory.mktemp("flood") / "home"
    assert gpumesh(home, "init", "--name", "flooded").returncode == 0
    running = start_control(home)
    try:
        yield running
    finally:
        _, err = running.stop()
        assert "Traceback" not in err, err


class Flood:
    """`floodclient.py hold` as another local user: connections held until stopped."""

    def __init__(
        self,
        user: OtherUser | None,
        port: int,
        idle: int,
        half: int,
        *,
        host: str = "127.0.0.1",
        inside: tuple[str, ...] = (),
        source: str = "",
        bodies: bool = False,
    ) -> None:
        argv = [PYTHON, "-I", FLOOD, "hold", host, str(port), str(idle), str(half)]
        argv += [str(CEILING), *(["bodies"] if bodies else [])]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        if source:
            env["FLOOD_SOURCE"] = source
        self.proc = subprocess.Popen(
            [*inside, *(user.argv(*argv) if user is not None else argv)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip() == f"held {idle + half}", (line, self.proc.stderr)

    def told(self) -> dict[str, object]:
        """Stop holding; what each connection was told before it closed."""
        out, err = self.proc.communicate("", timeout=CEILING * 2)
        assert self.proc.returncode == 0, err
        result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
        return result


# --- bodies ---------------------------------------------------------------------------------


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_200_mb_body_to_the_login_exchange_is_refused_unread(
    control: Control, other_user: OtherUser, framing: str
) -> None:
    before = control.high_water()
    sent = other_user.run(
        PYTHON, "-I", FLOOD, "body", "127.0.0.1", str(control.port),
        "/api/v1/auth/session", "200", framing, timeout=CEILING * 2,
    )  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    answer = json.loads(sent.stdout)
    assert answer["status"].startswith("HTTP/1.1 413"), answer
    assert json.loads(answer["body"]) == {
        "code": "limit",
        "message": "the request body is over 4096 bytes, this route's limit",
    }
    assert control.high_water() - before <= 50 * 1024 * 1024


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_200_mb_body_to_an_authorised_route_is_refused_unread(
    control: Control, framing: str
) -> None:
    before = control.high_water()
    answer = send_body(
        "127.0.0.1", control.port, "/api/v1/jobs", 200, chunked=framing == "chunked",
        token=control.token,
    )  # fmt: skip
    assert answer["status"].startswith("HTTP/1.1 413"), answer
    message = json.loads(str(answer["body"]))["message"]
    assert message == "the request body is over 1048576 bytes, this route's limit"
    assert control.high_water() - before <= 50 * 1024 * 1024
    # The server still answers after it.
    with control.unix() as unix:
        assert unix.get("/api/v1/node").status_code == 200


# --- held connections -----------------------------------------------------------------------


def _the_owner_is_answered(control: Control) -> None:
    """The owner's authorised request over TCP, and on the unix socket, get a 200."""
    with httpx.Client(timeout=CEILING) as client:
        response = client.get(
            f"{control.url}/api/v1/node",
            headers={"authorization": f"Bearer {control.token}"},
        )
    assert response.status_code == 200, response.text
    with control.unix() as unix:
        assert unix.get("/api/v1/node").status_code == 200


def test_held_connections_leave_room_and_are_closed_by_the_deadline(
    control: Control, other_user: OtherUser
) -> None:
    flood = Flood(other_user, control.port, idle=150, half=150, bodies=True)
    try:
        # The owner's authorised request over TCP, and on the unix socket, are
        # answered while the 300 connections are held.
        _the_owner_is_answered(control)
    finally:
        told = flood.told()
    # None stayed open: each was closed by the deadline and told so in one line
    # naming the limit and its number. (Loopback addresses share the total cap:
    # any local user may use any of 127/8, so none is pushed out for its address.)
    assert told["open"] == 0, told
    answers = [str(a) for a in told["answers"]]  # type: ignore[attr-defined]
    assert len(answers) == 300
    assert all(a.startswith("HTTP/1.1 408") for a in answers), answers[:3]
    messages = {json.loads(a.partition("\r\n\r\n")[2])["message"] for a in answers}
    assert messages == {
        "the request was not complete within 3 s, the request deadline: "
        "send the whole request at once"
    }


def test_a_full_server_makes_room_at_the_cost_of_the_oldest_waiting_connections(
    tmp_path: Path, other_user: OtherUser
) -> None:
    home = tmp_path / "home"
    assert gpumesh(home, "init", "--name", "full").returncode == 0
    running = start_control(home, env=_env(home, GPUMESH_HTTP_CONNECTIONS="50"))
    try:
        flood = Flood(other_user, running.port, idle=150, half=150)
        try:
            _the_owner_is_answered(running)
        finally:
            told = flood.told()
    finally:
        _, err = running.stop()
    assert "Traceback" not in err, err
    assert told["open"] == 0, told
    answers = [str(a) for a in told["answers"]]  # type: ignore[attr-defined]
    room = [a for a in answers if a.startswith("HTTP/1.1 503")]
    late = [a for a in answers if a.startswith("HTTP/1.1 408")]
    assert len(room) + len(late) == 300 and len(room) >= 250, (len(room), len(late))
    assert "holds 50 connections, its limit" in room[0]


def test_the_node_process_lifts_its_descriptor_limit_to_the_hard_one(control: Control) -> None:
    limits = Path(f"/proc/{control.proc.pid}/limits").read_text().splitlines()
    soft, hard = next(line for line in limits if line.startswith("Max open files")).split()[3:5]
    assert int(soft) == resource.getrlimit(resource.RLIMIT_NOFILE)[1] == int(hard)
    assert int(soft) > SOFT_FILES  # it was started with 256


def test_the_unix_socket_has_the_deadline_too(control: Control) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(CEILING)
        sock.connect(str(control.home / "control.sock"))
        sock.sendall(b"GET /api/v1/node HTTP/1.1\r\nHost: gpumesh\r\n")  # never finished
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"not complete within 3 s, the request deadline" in answer


# --- --allow-remote -------------------------------------------------------------------------


def _one_line(result: subprocess.CompletedProcess[str], text: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and text in lines[0], lines


def _cert(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def test_allow_remote_refuses_a_short_token_and_plain_http(
    control: Control, tmp_path: Path
) -> None:
    def run(token: str, *args: str) -> subprocess.CompletedProcess[str]:
        env = _env(control.home, GPUMESH_API_TOKEN=token)
        return subprocess.run(
            [CONTROL, "--listen", "0.0.0.0:0", "--allow-remote", *args],
            env=env, capture_output=True, text=True, timeout=CEILING, check=False,
        )  # fmt: skip

    _one_line(run("a"), "GPUMESH_API_TOKEN has 1 characters and --allow-remote needs at least 32")
    _one_line(run("x" * 31), "has 31 characters")
    _one_line(run("x" * 32), "--allow-remote needs --tls-cert FILE and --tls-key FILE")
    _one_line(
        run("x" * 32, "--tls-cert", str(tmp_path / "none.pem"), "--tls-key", str(tmp_path / "k")),
        "--tls-cert " + str(tmp_path / "none.pem") + ": no such file",
    )


def test_allow_remote_serves_https_and_answers_429_after_five_wrong_tokens(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    assert gpumesh(home, "init", "--name", "remote").returncode == 0
    cert, key = _cert(tmp_path)
    token = "t" * 40
    env = _env(home, GPUMESH_API_TOKEN=token, GPUMESH_API_BACKOFF="0.5")
    running = start_control(
        home, "--allow-remote", "--tls-cert", str(cert), "--tls-key", str(key), env=env
    )
    try:
        assert running.scheme == "https"
        with pytest.raises(httpx.HTTPError):  # no plain HTTP beside it
            httpx.get(f"http://127.0.0.1:{running.port}/api/v1/node", timeout=CEILING)
        with httpx.Client(
            base_url=running.url, verify=ssl.create_default_context(cafile=cert), timeout=CEILING
        ) as client:

            def node(bearer: str) -> httpx.Response:
                return client.get("/api/v1/node", headers={"authorization": f"Bearer {bearer}"})

            assert node(token).status_code == 200
            assert [node("wrong").status_code for _ in range(5)] == [401] * 5
            refused = node(token)  # even the right one: a guess now learns nothing
            assert refused.status_code == 429
            assert refused.json()["message"].startswith(
                "5 wrong API tokens in a row from 127.0.0.1, over the limit of 5: refused for"
            )
            end = time.monotonic() + CEILING
            while node(token).status_code == 429:
                assert time.monotonic() < end
                time.sleep(0.1)
            assert node(token).status_code == 200  # a right token clears the count
        with running.unix() as unix:  # the owner's socket beside it stays plain
            assert unix.get("/api/v1/node").status_code == 200
    finally:
        _, err = running.stop()
    assert "Traceback" not in err, err


# --- the registry ---------------------------------------------------------------------------


def test_the_registry_answers_while_a_stranger_holds_slow_connections(tmp_path: Path) -> None:
    port = _free_tcp_port()
    proc = subprocess.Popen(
        _few_files(sys.executable, "-m", "gpumesh.registry.main", "--listen",
                   f"127.0.0.1:{port}", "--db", str(tmp_path / "r.db"), "--log-level", "warning"),
        env=dict(os.environ, GPUMESH_HTTP_DEADLINE=str(DEADLINE)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert "listening on" in proc.stdout.readline()
        flood = Flood(None, port, idle=150, half=150)
        try:
            response = httpx.get(f"http://127.0.0.1:{port}/v1/listings", timeout=CEILING)
            assert response.status_code == 200, response.text
        finally:
            told = flood.told()
        assert told["open"] == 0, told
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=CEILING)
    assert "Traceback" not in err, err


# --- a peer's work while the provider's node process is flooded -----------------------------


@pytest.mark.usefixtures("docker_daemon")
def test_a_peers_cp_and_job_succeed_while_another_user_holds_connections(
    tmp_path: Path, other_user: OtherUser
) -> None:
    from tests.integration.test_cli import _free_udp_port, _init

    image = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")
    alice, bob = tmp_path / "a", tmp_path / "b"
    _init(alice, "alice-pc", _free_udp_port())
    _init(bob, "bob-laptop")
    for home in (alice, bob):
        assert gpumesh(home, "config", "set", "image", image).returncode == 0
    # alice shares as her node process (which serves her API) with few descriptors.
    share = subprocess.Popen(
        _few_files(sys.executable, "-m", "gpumesh", "share"),
        env=_env(alice),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        end = time.monotonic() + CEILING
        while not (alice / "control.sock").exists():
            assert share.poll() is None and time.monotonic() < end, share.communicate()
            time.sleep(0.1)
        assert gpumesh(bob, "pair", gpumesh(alice, "pair-code").stdout.strip()).returncode == 0
        assert gpumesh(alice, "pair", gpumesh(bob, "pair-code").stdout.strip()).returncode == 0
        port = _free_tcp_port()
        with httpx.Client(
            transport=httpx.HTTPTransport(uds=str(alice / "control.sock")),
            base_url="http://gpumesh",
            timeout=CEILING,
        ) as unix:  # as `gpumesh dashboard` does: TCP on loopback too
            served = unix.post("/api/v1/node/tcp", json={"listen": f"127.0.0.1:{port}"})
            assert served.status_code == 200, served.text
        flood = Flood(other_user, port, idle=150, half=150)
        try:
            folder = tmp_path / "flood"
            folder.mkdir()
            (folder / "data.txt").write_text("through the flood\n")
            copied = gpumesh(bob, "cp", "-r", str(folder), "alice-pc:/flood", timeout=CEILING * 2)
            assert copied.returncode == 0, copied.stderr
            ran = gpumesh(
                bob, "run", "--peer", "alice-pc", "-q", "--mount", "/flood:/d", "--",
                "cat", "/d/data.txt", timeout=CEILING * 2,
            )  # fmt: skip
            assert ran.returncode == 0, ran.stderr
            assert "through the flood" in ran.stdout
        finally:
            flood.told()
    finally:
        if share.poll() is None:
            share.send_signal(signal.SIGINT)
        _, err = share.communicate(timeout=CEILING)
        from tests.integration.conftest import remove_containers

        remove_containers(json.loads(gpumesh(alice, "status", "--json").stdout)["node_id"])
    assert "Too many open files" not in err, err


@pytest.fixture
def namespace() -> Iterator[tuple[str, ...]]:
    """A network namespace of this test's own whose loopback interface also holds
    10.77.0.1-3, addresses that are not loopback ones (so they are capped)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        if os.environ.get("CI", "") not in ("", "0", "false", "no"):
            raise AssertionError("CI runs as root with iproute2: this test needs them")
        pytest.skip("needs root and iproute2 for a network namespace")
    name = f"gm-http-{os.getpid()}-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        inside = ("ip", "netns", "exec", name)
        subprocess.run([*inside, "ip", "link", "set", "lo", "up"], check=True, timeout=30)
        for address in ("10.77.0.1/32", "10.77.0.2/32", "10.77.0.3/32"):
            subprocess.run(
                [*inside, "ip", "addr", "add", address, "dev", "lo"], check=True, timeout=30
            )
        yield inside
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, timeout=30)


def test_one_address_over_its_cap_pushes_out_only_its_own_connections(
    tmp_path: Path, namespace: tuple[str, ...]
) -> None:
    port = 47080
    proc = subprocess.Popen(
        [*namespace, *_few_files(sys.executable, "-m", "gpumesh.registry.main", "--listen",
         f"10.77.0.1:{port}", "--db", str(tmp_path / "r.db"), "--log-level", "warning")],
        env=dict(os.environ, GPUMESH_HTTP_DEADLINE=str(DEADLINE)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert "listening on" in proc.stdout.readline()
        flood = Flood(
            None, port, idle=150, half=150, host="10.77.0.1", inside=namespace, source="10.77.0.2"
        )
        try:
            got = subprocess.run(
                [*namespace, PYTHON, "-I", FLOOD, "get", "10.77.0.1", str(port), "/v1/listings"],
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "FLOOD_SOURCE": "10.77.0.3"},
                capture_output=True, text=True, timeout=CEILING, check=False,
            )  # fmt: skip
            assert got.stdout.strip() == "HTTP/1.1 200 OK", (got.stdout, got.stderr)
        finally:
            told = flood.told()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=CEILING)
    assert "Traceback" not in err, err
    assert told["open"] == 0, told
    answers = [str(a) for a in told["answers"]]  # type: ignore[attr-defined]
    room = [a for a in answers if a.startswith("HTTP/1.1 503")]
    late = [a for a in answers if a.startswith("HTTP/1.1 408")]
    assert (len(room), len(late)) == (236, 64), (len(room), len(late))
    assert "10.77.0.2 holds 64 connections, the limit per address" in room[0]
