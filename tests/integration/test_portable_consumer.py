"""A consumer on macOS and Windows, simulated: the real CLI with the Linux-only
facilities switched off (``GPUMESH_TEST_PLATFORM``, ``GPUMESH_TEST_WITHOUT``)
against a real `gpumesh share` on Linux, real QUIC over loopback and real Docker.

Only Linux machines run these tests, so this is the code the other platforms
take, not a run on them. Each run also shows that code was taken: the consumer
appends every fallback it took to a report file (``took NAME``), and any
Linux-only call it still made (``used NAME``, seen by an audit hook) fails it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import gpumesh, remove_containers
from tests.integration.node import shares
from tests.integration.test_cli import _free_udp_port, _init, _start_share
from tests.integration.test_exec import Terminal

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")

IMAGE = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")


class Consumer:
    """bob's CLI, run as on another platform."""

    def __init__(self, home: Path, report: Path, switches: dict[str, str]) -> None:
        self.home = home
        self.report = report
        self.env = dict(
            os.environ, GPUMESH_HOME=str(home), GPUMESH_TEST_PLATFORM_REPORT=str(report)
        )
        self.env.pop("GPUMESH_LOG", None)
        self.env.update(switches)

    def __call__(
        self, *args: str, stdin: str | None = None, code: int = 0, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [sys.executable, "-m", "gpumesh", *args],
            env=self.env,
            input=stdin,
            stdin=None if stdin is not None else subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert result.returncode == code, (args, result.returncode, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr, result.stderr
        return result

    def taken(self) -> set[str]:
        lines = self.report.read_text().splitlines() if self.report.exists() else []
        used = [line for line in lines if " used " in line]
        assert not used, f"Linux-only calls made while switched off: {used}"
        return {line.split(" took ", 1)[1] for line in lines if " took " in line}


@contextlib.contextmanager
def _consumer_on(tmp_path: Path, switches: dict[str, str]) -> Iterator[tuple[Path, Consumer]]:
    """alice shares (plain Linux); bob, the consumer under ``switches``, makes his
    node and pairs with her through his own CLI."""
    alice, bob_home = tmp_path / "a", tmp_path / "b"
    _init(alice, "alice-pc", _free_udp_port())
    assert gpumesh(alice, "config", "set", "image", IMAGE).returncode == 0
    bob = Consumer(bob_home, tmp_path / "platform-report", switches)
    bob("init", "--name", "bob-laptop")
    bob("config", "set", "listen_host", "127.0.0.1")
    bob("config", "set", "image", IMAGE)
    share = _start_share(alice)
    try:
        bob("pair", gpumesh(alice, "pair-code").stdout.strip())
        code = bob("pair-code").stdout.strip()
        assert gpumesh(alice, "pair", code).returncode == 0
        yield alice, bob
    finally:
        share.terminate()
        share.communicate(timeout=15)
        remove_containers(json.loads(gpumesh(alice, "status", "--json").stdout)["node_id"])


def _tree(root: Path) -> dict[str, bytes | None]:
    return {
        str(path.relative_to(root)): path.read_bytes() if path.is_file() else None
        for path in sorted(root.rglob("*"))
    }


@pytest.mark.parametrize("simulated", ["windows", "macos"])
def test_every_consumer_command_works_on_the_simulated_platform(
    tmp_path: Path, simulated: str
) -> None:
    with _consumer_on(tmp_path, {"GPUMESH_TEST_PLATFORM": simulated}) as (_alice, bob):
        assert "alice-pc" in bob("connect", "alice-pc").stdout

        # run with a working folder, and logs of a detached job
        work = tmp_path / "work"
        work.mkdir()
        (work / "input.txt").write_text("from the laptop\n")
        ran = bob("run", "--peer", "alice-pc", "--workdir", str(work), "--", "cat", "input.txt")
        assert "from the laptop" in ran.stdout
        detached = bob(
            "run", "--peer", "alice-pc", "--detach", "--", "sh", "-c", "echo later; exit 4"
        )
        job_id = detached.stdout.strip().split()[-1]
        logs = bob("logs", "-f", job_id, code=4)
        assert "later" in logs.stdout

        # cp: a file (bytes a text mode would change) and a folder, up and down
        data = b"line one\r\nline two\n\x00\x1a" + os.urandom(200_000)
        (tmp_path / "data.bin").write_bytes(data)
        bob("cp", str(tmp_path / "data.bin"), "alice-pc:/data.bin")
        bob("cp", "alice-pc:/data.bin", str(tmp_path / "back.bin"))
        assert (tmp_path / "back.bin").read_bytes() == data
        folder = tmp_path / "folder"
        (folder / "sub").mkdir(parents=True)
        (folder / "a.txt").write_text("alpha\n")
        (folder / "sub" / "b.bin").write_bytes(os.urandom(70_000))
        bob("cp", str(folder), "alice-pc:/")
        down = tmp_path / "down"
        down.mkdir()
        bob("cp", "alice-pc:/folder", str(down))
        assert _tree(down / "folder") == _tree(folder)

        # app: sync, run with its output pulled back, pull again later
        project = tmp_path / "proj"
        project.mkdir()
        (project / "a.txt").write_text("alpha\n")
        bob("app", "sync", "--peer", "alice-pc", "--dir", str(project))
        out = tmp_path / "renders"
        script = "mkdir -p renders && cp a.txt renders/copy.txt && echo rendered"
        app_run = bob(
            "app", "run", "--peer", "alice-pc", "--dir", str(project), "--out", str(out),
            "--", "sh", "-c", script,
        )  # fmt: skip
        assert "rendered" in app_run.stdout
        assert (out / "copy.txt").read_text() == "alpha\n"
        later = tmp_path / "later"
        jobs = json.loads(bob("jobs", "--json").stdout)
        app_job = next(job["job_id"] for job in jobs if job["command"][-1] == script)
        bob("app", "pull", "--peer", "alice-pc", "--job", app_job, "--dir", str(later))
        assert (later / "renders" / "copy.txt").read_text() == "alpha\n"

        # exec with piped stdin
        shell = bob("exec", "alice-pc", "sh", stdin="echo piped-$((6 * 7))\nexit 3\n", code=3)
        assert "piped-42" in shell.stdout

        taken = bob.taken()
    assert {"gso", "gro"} <= taken  # the UDP socket was made without offloads
    if simulated == "windows":
        # no sendmsg, a selector loop, stdin read on a thread, reads by seek,
        # folders walked by path, files opened without O_NOFOLLOW or O_NONBLOCK
        assert {"sendmsg", "add_reader", "pread", "dir_fd", "nofollow", "oflags"} <= taken
    else:
        assert "sendmsg" not in taken and "add_reader" not in taken


@pytest.mark.parametrize("facility", ["sendmsg", "add_reader", "pread", "dir_fd", "nofollow"])
def test_each_facility_alone_off_copies_and_runs(tmp_path: Path, facility: str) -> None:
    with _consumer_on(tmp_path, {"GPUMESH_TEST_WITHOUT": facility}) as (_alice, bob):
        folder = tmp_path / "folder"
        (folder / "sub").mkdir(parents=True)
        (folder / "sub" / "b.bin").write_bytes(os.urandom(300_000))
        bob("cp", str(folder), "alice-pc:/")
        down = tmp_path / "down"
        down.mkdir()
        bob("cp", "alice-pc:/folder", str(down))
        assert _tree(down / "folder") == _tree(folder)
        bob("cp", str(folder / "sub" / "b.bin"), "alice-pc:/one.bin")
        bob("cp", "alice-pc:/one.bin", str(down / "one.bin"))
        assert (down / "one.bin").read_bytes() == (folder / "sub" / "b.bin").read_bytes()
        shell = bob("exec", "alice-pc", "sh", stdin="echo piped-$((6 * 7))\n")
        assert "piped-42" in shell.stdout
        assert bob.taken() == {facility}


def test_share_elsewhere_than_linux_is_one_clear_refusal(tmp_path: Path) -> None:
    home = tmp_path / "a"
    _init(home, "alice-pc", _free_udp_port())
    for simulated, shown in (("macos", "macOS"), ("windows", "Windows")):
        env = dict(os.environ, GPUMESH_HOME=str(home), GPUMESH_TEST_PLATFORM=simulated)
        result = subprocess.run(
            [sys.executable, "-m", "gpumesh", "share"],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert result.returncode == 6, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        assert f"needs Linux (this is {shown})" in lines[0]
        assert not shares(home)


def test_a_terminal_without_termios_runs_the_shell_as_a_pipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Windows: a console but no raw mode; lines go through as typed, read on a thread."""
    with _consumer_on(tmp_path, {}) as (_alice, bob):
        monkeypatch.setenv("GPUMESH_TEST_PLATFORM", "windows")
        monkeypatch.setenv("GPUMESH_TEST_PLATFORM_REPORT", str(bob.report))
        shell = Terminal(bob.home, "exec", "alice-pc", "sh")
        try:
            shell.send("tty || echo no-$((6 * 7))-terminal\n")
            shell.expect(b"no-42-terminal")
            shell.send("exit 4\n")
            assert shell.wait() == 4
        finally:
            shell.close()
        assert {"termios", "add_reader", "signals"} <= bob.taken()


def test_a_terminal_without_sigwinch_or_signal_handlers_still_follows_and_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Raw mode is there; the window's size is polled, SIGTERM goes through signal.signal."""
    with _consumer_on(tmp_path, {}) as (_alice, bob):
        monkeypatch.setenv("GPUMESH_TEST_WITHOUT", "sigwinch,signals,add_reader")
        monkeypatch.setenv("GPUMESH_TEST_PLATFORM_REPORT", str(bob.report))
        shell = Terminal(bob.home, "exec", "alice-pc", rows=30, cols=100)
        try:
            shell.expect(b"$ ")
            shell.send("busybox stty size\r")
            shell.expect(b"30 100")
            shell.resize(40, 120)
            for attempt in range(40):
                shell.send("busybox stty size\r")
                try:
                    shell.expect(b"40 120", timeout=0.5)
                    break
                except AssertionError:
                    assert attempt < 39, "the remote terminal never got the new size"
            shell.proc.send_signal(signal.SIGTERM)
            assert shell.wait() == 143
        finally:
            shell.close()
        assert bob.taken() == {"sigwinch", "signals", "add_reader"}
