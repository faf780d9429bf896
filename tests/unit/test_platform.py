"""gpumesh.platform: the switches that simulate macOS and Windows, what each
takes away, the fallbacks on the consumer's path, and cp's drive-letter rule."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumesh import platform
from gpumesh.blocking import run_async
from gpumesh.client.files import parse_location
from gpumesh.errors import ConfigError
from gpumesh.files.pack import scan
from gpumesh.store.sockets import socket_name
from gpumesh.transport.udp import UdpSocket, open_udp_socket

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="simulates others from Linux")


@pytest.fixture
def simulate() -> Iterator[object]:
    """``simulate(GPUMESH_TEST_PLATFORM=..., ...)`` for one test; the real machine after."""

    def switch(**environ: str) -> None:
        platform.configure(environ)

    yield switch
    platform.configure({})


def test_the_real_machine_has_everything_and_takes_no_fallback(simulate) -> None:
    simulate()
    assert platform.system() == "linux"
    assert all(platform.has(name) for name in platform.FACILITIES)
    assert platform.taken() == frozenset()


def test_each_simulated_platform_takes_away_what_that_os_lacks(simulate) -> None:
    simulate(GPUMESH_TEST_PLATFORM="macos")
    assert platform.system() == "macos"
    missing = {name for name in platform.FACILITIES if not platform.has(name)}
    assert missing == {"gso", "gro", "procfd"}
    assert platform.taken() == missing

    simulate(GPUMESH_TEST_PLATFORM="windows")
    assert platform.system() == "windows"
    assert not any(platform.has(name) for name in platform.FACILITIES)
    assert platform.open_flag("O_NOFOLLOW") == 0
    assert platform.open_flag("O_CLOEXEC") == 0


def test_single_facilities_switch_off_alone_and_a_typo_is_a_clear_error(simulate) -> None:
    simulate(GPUMESH_TEST_WITHOUT="gso, unix")
    assert platform.system() == "linux"
    assert {n for n in platform.FACILITIES if not platform.has(n)} == {"gso", "unix"}
    with pytest.raises(ConfigError, match="unknown facility 'gos'"):
        simulate(GPUMESH_TEST_WITHOUT="gos")
    with pytest.raises(ConfigError, match="use linux, macos or windows"):
        simulate(GPUMESH_TEST_PLATFORM="beos")


def test_udp_without_offloads_or_sendmsg_still_moves_datagrams(simulate) -> None:
    simulate(GPUMESH_TEST_PLATFORM="windows")
    a = UdpSocket(open_udp_socket("127.0.0.1", 0))
    b = UdpSocket(open_udp_socket("127.0.0.1", 0))
    try:
        assert (a.gso, a.gro) == (False, False)
        a.send_batch([(bytes([n]) * 1200, b.local_address) for n in range(8)])
        got: list[bytes] = []
        for _ in range(3000):  # loopback delivers at once; the bound only ends a broken run
            got += [r.data for r in b.receive_batch()]
            if len(got) >= 8:
                break
            time.sleep(0.01)
        assert got == [bytes([n]) * 1200 for n in range(8)]
    finally:
        a.close()
        b.close()
    assert {"gso", "gro", "sendmsg"} <= platform.taken()


def test_a_long_socket_path_without_proc_is_refused_not_reached_through_proc(
    simulate, tmp_path: Path
) -> None:
    deep = tmp_path / ("x" * 100)
    deep.mkdir()
    simulate(GPUMESH_TEST_PLATFORM="macos")
    with pytest.raises(OSError, match="too long for a unix socket"), socket_name(deep, "x.sock"):
        pass


def test_a_folder_walked_by_path_packs_what_the_descriptor_walk_packs(
    simulate, tmp_path: Path
) -> None:
    root = tmp_path / "proj"
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "a.txt").write_text("alpha\n")
    (root / "sub" / "b.bin").write_bytes(os.urandom(5000))
    (root / "sub" / "deeper" / "c").write_text("c")
    (root / "build").mkdir()
    (root / "build" / "out.o").write_text("x")
    (root / ".gpumeshignore").write_text("build/\n")
    (root / "link").symlink_to("sub/b.bin")
    (root / "outside").symlink_to("/etc/hostname")
    simulate()
    walked_by_descriptor = scan(root)
    simulate(GPUMESH_TEST_WITHOUT="dir_fd")
    walked_by_path = scan(root)
    assert "dir_fd" in platform.taken()
    assert walked_by_path.files == walked_by_descriptor.files
    assert walked_by_path.skipped == walked_by_descriptor.skipped
    assert walked_by_path.root_fd is None
    assert {e.path for e in walked_by_path.files} >= {"a.txt", "sub/b.bin", "link"}


def test_reads_by_seek_give_the_bytes_pread_gives(simulate, tmp_path: Path) -> None:
    data = os.urandom(10_000)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        simulate(GPUMESH_TEST_WITHOUT="pread")
        assert platform.pread(fd, 100, 5000) == data[5000:5100]
        buffer = bytearray(300)
        assert platform.preadv(fd, memoryview(buffer), 9800) == 200
        assert bytes(buffer[:200]) == data[9800:]
    finally:
        os.close(fd)


def test_signals_without_add_signal_handler_reach_the_loop(simulate) -> None:
    simulate(GPUMESH_TEST_WITHOUT="signals")

    async def main() -> int:
        loop = asyncio.get_running_loop()
        got: asyncio.Future[int] = loop.create_future()
        undo = platform.add_signal_handler(loop, signal.SIGUSR1, lambda: got.set_result(1))
        try:
            os.kill(os.getpid(), signal.SIGUSR1)
            return await asyncio.wait_for(got, 30)
        finally:
            undo()

    assert run_async(main()) == 1
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_without_add_reader_the_loop_is_a_selector_loop(simulate) -> None:
    simulate(GPUMESH_TEST_PLATFORM="windows")

    async def kind() -> str:
        return type(asyncio.get_running_loop()).__name__

    assert "Selector" in run_async(kind())


@pytest.mark.parametrize(
    ("text", "peer", "path"),
    [
        ("C:\\data\\x.bin", None, "C:\\data\\x.bin"),
        ("C:/data", None, "C:/data"),
        ("d:data", None, "d:data"),
        ("alice-pc:/data.bin", "alice-pc", "/data.bin"),
        ("ab:x", "ab", "x"),
        (".\\a:b", None, ".\\a:b"),
    ],
)
def test_on_windows_a_drive_letter_is_a_local_path(
    simulate, text: str, peer: str | None, path: str
) -> None:
    simulate(GPUMESH_TEST_PLATFORM="windows")
    location = parse_location(text)
    assert (location.peer, location.path) == (peer, path)


def test_elsewhere_a_one_letter_peer_stays_a_peer(simulate) -> None:
    simulate(GPUMESH_TEST_PLATFORM="macos")
    assert parse_location("c:/data").peer == "c"


def test_the_cli_reports_each_fallback_once_and_a_linux_only_call(tmp_path: Path) -> None:
    """The report a test reads: ``took`` per fallback, ``used`` for a slip (here
    made on purpose: an AF_UNIX socket while ``unix`` is switched off)."""
    report = tmp_path / "report"
    code = (
        "import socket; from gpumesh import platform\n"
        "platform.has('unix'); platform.has('unix')\n"
        "socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).close()\n"
        "socket.socketpair()[0].close()\n"
    )
    env = dict(os.environ, GPUMESH_TEST_WITHOUT="unix", GPUMESH_TEST_PLATFORM_REPORT=str(report))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    lines = [line.split(" ", 1)[1] for line in report.read_text().splitlines()]
    assert lines[0] == "took unix"
    assert len(lines) == 2 and lines[1].startswith("used unix at ")


_IMPORT_AS_ON_WINDOWS = """
import importlib, os, pkgutil, signal, socket, sys
for name in ("O_NOFOLLOW", "O_DIRECTORY", "O_CLOEXEC", "O_NONBLOCK", "pread", "preadv",
             "fchmod", "fchown", "getuid", "geteuid", "getgid", "getegid", "memfd_create",
             "set_blocking"):
    if hasattr(os, name):
        delattr(os, name)
for name in ("AF_UNIX", "CMSG_SPACE", "CMSG_LEN"):
    if hasattr(socket, name):
        delattr(socket, name)
for name in ("SIGWINCH", "SIGHUP", "SIGUSR1"):
    if hasattr(signal, name):
        delattr(signal, name)
for name in ("fcntl", "termios", "tty", "pwd", "grp", "resource"):
    sys.modules[name] = None
failed = []
for package in ("cli", "client", "transport", "store", "files", "identity", "protocol", "gpu",
                "daemon", "control"):
    found = importlib.import_module("gpumesh." + package)
    for info in pkgutil.walk_packages(found.__path__, found.__name__ + "."):
        try:
            importlib.import_module(info.name)
        except Exception as exc:
            failed.append(f"{info.name}: {exc!r}")
print("\\n".join(failed))
"""


def test_every_consumer_module_imports_without_what_windows_lacks() -> None:
    """Nothing on the consumer's floors touches a Linux-only name at import: the
    attributes and modules Windows lacks are removed first (the provider's
    ``agent/``, ``runtime/`` and ``relay/`` are left out: they need Linux; the node
    process's ``daemon/`` and ``control/`` are in)."""
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_AS_ON_WINDOWS],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert result.stdout.strip() == "", result.stdout
