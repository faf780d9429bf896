"""Real desktop servers and clients through the tunnel (scripts/ensure-desktop.sh
installs them; never skipped in CI).

The provider side is a headless X server (Xvfb) with a real VNC server (x11vnc)
or RDP server (freerdp-shadow-cli) on it; `gpumesh share` and `gpumesh desktop
connect` are the real CLI; the clients are vncdotool's `vncdo` and `xfreerdp`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import gpumesh
from tests.integration.test_desktop_cli import _connect, homes  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("desktop_programs", "gpumesh_processes")

CEILING = 30.0
START_CEILING = 120.0
"""A server's start (freerdp-shadow-cli took over 30 s once at load ~10)."""
X11VNC_FLAGS = ("-localhost", "-nopw", "-forever", "-shared", "-nocursor", "-quiet")
RDP_FLAGS = ("/u:tester", "/p:secret", "/cert:ignore", "+auth-only")
INPUT = ("move", "350", "350", "click", "1", "key", "a")


def _vncdo() -> str:
    found = Path(sys.executable).with_name("vncdo")
    return str(found) if found.exists() else "vncdo"


def _free_tcp_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_listening(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_CEILING
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        assert proc.poll() is None, f"{proc.args} exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"{proc.args} did not listen on {port}"
        time.sleep(0.1)


@contextlib.contextmanager
def _started(
    command: list[str], env: dict[str, str], log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def _xvfb(tmp_path: Path, size: str = "640x480x24") -> Iterator[dict[str, str]]:
    """A headless X display; yields the environment that names it."""
    read, write = os.pipe()
    proc = subprocess.Popen(
        # -noreset: by default the server resets when its last client leaves
        # (the display probe below), and a server started in that window
        # (freerdp-shadow-cli) cannot open the display and exits 255.
        ["Xvfb", "-displayfd", str(write), "-screen", "0", size, "-nolisten", "tcp", "-noreset"],
        pass_fds=(write,),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(write)
    try:
        with os.fdopen(read) as pipe:
            number = pipe.readline().strip()
        assert number, "Xvfb did not report its display"
        env = dict(os.environ, DISPLAY=f":{number}", HOME=str(tmp_path))
        _wait_display(env, proc)
        yield env
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _wait_display(env: dict[str, str], proc: subprocess.Popen[bytes]) -> None:
    """Until a client can open the display: a server started next (x11vnc,
    freerdp-shadow) that cannot open it gives up at once."""
    deadline = time.monotonic() + CEILING
    while True:
        probe = subprocess.run(
            ["xdotool", "getdisplaygeometry"], env=env, capture_output=True, check=False
        )
        if probe.returncode == 0:
            return
        assert proc.poll() is None, f"Xvfb exited ({proc.returncode})"
        assert time.monotonic() < deadline, probe.stderr
        time.sleep(0.1)


def _share(alice: Path, bob: Path, *flags: str) -> None:
    assert gpumesh(alice, "desktop", "share", *flags).returncode == 0
    assert gpumesh(alice, "desktop", "allow", "bob-laptop").returncode == 0


def _capture(target: str, path: Path) -> bytes:
    """The screen as raw RGB pixels, captured by vncdotool from ``target``."""
    from PIL import Image

    done = subprocess.run(
        [_vncdo(), "-s", target, "capture", str(path)],
        capture_output=True,
        timeout=CEILING,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    with Image.open(path) as image:
        return image.convert("RGB").tobytes()


def test_vnc_screen_keys_and_clicks_through_the_tunnel(
    tmp_path: Path,
    homes: tuple[Path, Path],  # noqa: F811
) -> None:
    alice, bob = homes
    vnc_port = _free_tcp_port()
    with (
        _xvfb(tmp_path) as env,
        _started(
            ["xmessage", "-geometry", "+40+40", "hello through the tunnel"], env, tmp_path / "m"
        ),
        _started(
            ["xev", "-geometry", "200x150+300+300", "-event", "keyboard", "-event", "button"],
            env,
            tmp_path / "xev.out",
        ),
        _started(
            ["x11vnc", "-display", env["DISPLAY"], "-rfbport", str(vnc_port), *X11VNC_FLAGS],
            env,
            tmp_path / "x11vnc.log",
        ) as vnc,
    ):
        _wait_listening(vnc_port, vnc)
        _share(alice, bob, "--vnc", "--port", str(vnc_port))
        proc, port = _connect(bob)
        try:
            direct = _capture(f"127.0.0.1::{vnc_port}", tmp_path / "direct.png")
            tunnelled = _capture(f"127.0.0.1::{port}", tmp_path / "tunnel.png")
            assert len(tunnelled) == 640 * 480 * 3
            assert tunnelled == direct
            assert len(set(tunnelled)) > 1  # the message window is on it, not one colour
            # A click and a key sent through the tunnel reach the X server.
            sent = subprocess.run(
                [_vncdo(), "-s", f"127.0.0.1::{port}", *INPUT],
                capture_output=True,
                timeout=CEILING,
                check=False,
            )
            assert sent.returncode == 0, sent.stderr
            where = subprocess.run(
                ["xdotool", "getmouselocation"], env=env, capture_output=True, text=True, check=True
            )
            assert where.stdout.startswith("x:350 y:350 ")
            deadline = time.monotonic() + CEILING
            while True:  # xev writes the events as the X server delivers them
                events = (tmp_path / "xev.out").read_text()
                if "ButtonPress event" in events and "(keysym 0x61, a)" in events:
                    break
                assert time.monotonic() < deadline, events
                time.sleep(0.1)
        finally:
            proc.terminate()
            proc.communicate(timeout=CEILING)


def test_rdp_handshake_through_the_tunnel(
    tmp_path: Path,
    homes: tuple[Path, Path],  # noqa: F811
) -> None:
    alice, bob = homes
    rdp_port = _free_tcp_port()
    with (
        _xvfb(tmp_path) as server_env,
        _xvfb(tmp_path, "320x240x24") as client_env,
        _started(
            ["freerdp-shadow-cli", "/bind-address:127.0.0.1", f"/port:{rdp_port}"],
            server_env,
            tmp_path / "shadow.log",
        ) as shadow,
    ):
        _wait_listening(rdp_port, shadow)
        _share(alice, bob, "--rdp", "--port", str(rdp_port))
        proc, port = _connect(bob)
        try:
            # +auth-only: the client negotiates security, runs TLS and authenticates,
            # then exits 0 without opening a window. Each connection gets its own stream.
            for _ in range(2):
                done = subprocess.run(
                    ["xfreerdp", f"/v:127.0.0.1:{port}", *RDP_FLAGS],
                    env=client_env,
                    capture_output=True,
                    text=True,
                    timeout=CEILING,
                    check=False,
                )
                assert done.returncode == 0, done.stdout + done.stderr
                assert "Authentication only, exit status 0" in done.stdout + done.stderr
        finally:
            proc.terminate()
            proc.communicate(timeout=CEILING)


# NTLM's hash of "secret" (MD4 of its UTF-16LE bytes), as `winpr-hash -u tester -p
# secret` prints it; written out because Python's hashlib has no MD4 under OpenSSL 3.
SAM_ENTRY = "tester:::878d8014606cda29677a44efa1353fc7:::\n"


def test_rdp_authentication_through_the_tunnel_refuses_a_wrong_password(
    tmp_path: Path,
    homes: tuple[Path, Path],  # noqa: F811
) -> None:
    """The RDP server (NLA against its own user list) decides: a wrong password is
    refused by it through the tunnel, the right one then gets in on the same tunnel."""
    alice, bob = homes
    rdp_port = _free_tcp_port()
    sam = tmp_path / "sam"
    sam.write_text(SAM_ENTRY)
    server = ["freerdp-shadow-cli", "/bind-address:127.0.0.1", f"/port:{rdp_port}"]
    log = tmp_path / "shadow.log"
    with (
        _xvfb(tmp_path) as server_env,
        _xvfb(tmp_path, "320x240x24") as client_env,
        _started([*server, "/sec:nla", f"/sam-file:{sam}"], server_env, log) as shadow,
    ):
        _wait_listening(rdp_port, shadow)
        _share(alice, bob, "--rdp", "--port", str(rdp_port))
        proc, port = _connect(bob)

        def login(password: str) -> subprocess.CompletedProcess[str]:
            flags = ("/u:tester", f"/p:{password}", "/cert:ignore", "+auth-only")
            return subprocess.run(
                ["xfreerdp", f"/v:127.0.0.1:{port}", *flags],
                env=client_env,
                capture_output=True,
                text=True,
                timeout=CEILING,
                check=False,
            )

        try:
            wrong = login("not-the-password")
            assert wrong.returncode != 0, wrong.stdout + wrong.stderr
            assert "Authentication only, exit status 1" in wrong.stdout + wrong.stderr
            assert "client authentication failure" in log.read_text()  # the server said no
            right = login("secret")
            assert right.returncode == 0, right.stdout + right.stderr
            assert "Authentication only, exit status 0" in right.stdout + right.stderr
            assert proc.poll() is None  # a refused login is no reason to end the tunnel
        finally:
            proc.terminate()
            proc.communicate(timeout=CEILING)
