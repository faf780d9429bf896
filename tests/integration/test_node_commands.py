"""`cp`, `app` and `exec` through real node processes: bob's CLI asks his home's
node process, which reads and writes his local paths and talks to alice (a real
`gpumesh share` process) over its warm session. Nothing is mocked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.node import node_env, status, wait_shares

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")


def run_in(
    home: Path, cwd: Path, *args: str, timeout: float = 120, **extra: str
) -> subprocess.CompletedProcess[str]:
    """``gpumesh ARGS`` for ``home`` through its node process, run in ``cwd``."""
    return subprocess.run(
        [sys.executable, "-m", "gpumesh", *args],
        env=node_env(home, **extra),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_cp_a_file_both_ways_with_relative_paths(pair: tuple[Path, Path], tmp_path: Path) -> None:
    _alice, bob = pair
    work = tmp_path / "work"
    work.mkdir()
    data = os.urandom(700_000)
    (work / "data.bin").write_bytes(data)
    up = run_in(bob, work, "cp", "--json", "data.bin", "alice-pc:/in/")
    assert up.returncode == 0, up.stderr
    view = json.loads(up.stdout)
    # The node process read bob's file from bob's folder; the view shows it as written.
    assert view["direction"] == "upload" and view["kind"] == "file"
    assert view["local"] == "data.bin" and view["remote"] == "/in/data.bin"
    assert view["size"] == len(data)
    assert status(bob)["node"]["detached"]  # it went through the node process

    down = run_in(bob, work, "cp", "alice-pc:/in/data.bin", "back.bin")
    assert down.returncode == 0, down.stderr
    assert (work / "back.bin").read_bytes() == data
    assert down.stdout == ""
    assert down.stderr.startswith("gpumesh: copied file alice-pc:/in/data.bin -> back.bin: ")
    warm = status(bob)["node"]["warm_sessions"]
    assert [w["peer"] for w in warm] == ["alice-pc"] and warm[0]["uses"] >= 2


def test_cp_a_folder_both_ways(pair: tuple[Path, Path], tmp_path: Path) -> None:
    _alice, bob = pair
    work = tmp_path / "work"
    (work / "proj" / "sub").mkdir(parents=True)
    (work / "proj" / "a.txt").write_text("alpha\n")
    (work / "proj" / "sub" / "run.sh").write_text("echo hi\n")
    (work / "proj" / "sub" / "run.sh").chmod(0o755)
    up = run_in(bob, work, "cp", "--json", "proj", "alice-pc:/")
    assert up.returncode == 0, up.stderr
    assert json.loads(up.stdout)["kind"] == "dir"
    out = tmp_path / "out"
    out.mkdir()
    down = run_in(bob, out, "cp", "-q", "alice-pc:/proj", ".")
    assert down.returncode == 0, down.stderr
    assert down.stderr == ""
    assert (out / "proj" / "a.txt").read_text() == "alpha\n"
    assert (out / "proj" / "sub" / "run.sh").read_text() == "echo hi\n"
    assert os.stat(out / "proj" / "sub" / "run.sh").st_mode & 0o777 == 0o755


def test_cp_errors_are_one_line_through_the_node_process(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    _alice, bob = pair
    missing = run_in(bob, tmp_path, "cp", "nothing-here.bin", "alice-pc:/x")
    assert missing.returncode != 0
    lines = missing.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "nothing-here.bin" in lines[0]
    both = run_in(bob, tmp_path, "cp", "alice-pc:/a", "alice-pc:/b")
    assert both.returncode == 2
    assert both.stderr.strip() == "error: both sides name a peer: one side must be a local path"


def test_app_sync_run_and_pull_through_the_node_process(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    _alice, bob = pair
    work = tmp_path / "work"
    (work / "proj").mkdir(parents=True)
    (work / "proj" / "a.txt").write_text("alpha\n")
    dry = run_in(bob, work, "app", "sync", "--peer", "alice-pc", "--dir", "proj", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines() == [
        "send    a.txt",
        "dry run: 1 to send, 0 to delete, 0 unchanged; nothing sent",
    ]
    synced = run_in(bob, work, "app", "sync", "--peer", "alice-pc", "--dir", "proj", "--json")
    assert synced.returncode == 0, synced.stderr
    assert json.loads(synced.stdout)["sent"] == ["a.txt"]

    (work / "proj" / "b.txt").write_text("beta\n")
    script = "mkdir -p renders && cat a.txt b.txt > renders/ab.txt && echo rendered && exit 3"
    ran = run_in(
        bob, work, "app", "run", "--peer", "alice-pc", "--dir", "proj", "--out", "renders",
        "--", "sh", "-c", script,
    )  # fmt: skip
    assert ran.returncode == 3, ran.stderr
    assert ran.stdout == "rendered\n"
    # Only the new file went: the sync's note says so, before the job's output.
    assert "synced /apps/proj on alice-pc: 1 sent" in ran.stderr
    assert "pulled alice-pc:/apps/proj/renders -> renders" in ran.stderr
    assert (work / "renders" / "ab.txt").read_text() == "alpha\nbeta\n"
    assert status(bob)["node"]["detached"]

    listed = json.loads(run_in(bob, work, "jobs", "--json").stdout)
    job_id = next(job["job_id"] for job in listed if job["role"] == "submitted")
    pulled = run_in(
        bob, work, "app", "pull", "--peer", "alice-pc", "--job", job_id, "--dir", "later"
    )
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout == "pulled alice-pc:/apps/proj -> later\n"
    assert (work / "later" / "renders" / "ab.txt").read_text() == "alpha\nbeta\n"


def test_exec_with_a_terminal_through_the_node_process(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real pty: raw mode, the window's size at start and after a resize, Ctrl-C
    to the remote program, and the remote exit code, all through the node process."""
    import termios

    from tests.integration.test_exec import Terminal

    _alice, bob = pair
    shell = Terminal(bob, "exec", "alice-pc", rows=30, cols=100)
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
        shell.send("sleep 30\r")
        shell.expect(b"sleep 30")
        shell.interrupt()  # raw mode: Ctrl-C reaches the remote shell, not gpumesh
        shell.send("echo still-$((1 + 1))\r")
        shell.expect(b"still-2", timeout=30)
        assert status(bob)["node"]["detached"]  # the node process ran the shell
        shell.send("exit 5\r")
        assert shell.wait(timeout=60) == 5
        fd = os.open(shell.slave_name, os.O_RDWR | os.O_NOCTTY)
        try:
            lflag = termios.tcgetattr(fd)[3]
        finally:
            os.close(fd)
        assert lflag & termios.ICANON and lflag & termios.ECHO  # out of raw mode again
    finally:
        shell.close()


def test_exec_without_a_terminal_pipes_stdin_through_the_node_process(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    _alice, bob = pair
    piped = subprocess.run(
        [sys.executable, "-m", "gpumesh", "exec", "alice-pc", "sh", "-c", "cat; exit 3"],
        env=node_env(bob),
        input="hello\nworld\n",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert piped.returncode == 3, piped.stderr
    assert piped.stdout == "hello\nworld\n"  # all of stdin, then its end
    unknown = run_in(bob, tmp_path, "exec", "nobody", "true")
    assert unknown.returncode == 2
    assert unknown.stderr.startswith("error: ") and len(unknown.stderr.strip().splitlines()) == 1
    assert "nobody" in unknown.stderr


def test_cp_app_and_exec_through_the_node_import_no_quic_crypto_or_docker(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    import textwrap

    _alice, bob = pair
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "a.txt").write_text("alpha\n")
    check = textwrap.dedent(
        """
        import sys
        from gpumesh.cli.main import main
        HEAVY = ("qh3", "cryptography", "docker")
        codes = []
        for argv in (["cp", "proj/a.txt", "alice-pc:/a.txt"],
                     ["cp", "--json", "alice-pc:/a.txt", "b.txt"],
                     ["app", "sync", "--peer", "alice-pc", "--dir", "proj"],
                     ["app", "run", "--peer", "alice-pc", "--dir", "proj", "--", "cat", "a.txt"],
                     ["exec", "alice-pc", "echo", "shell"]):
            codes.append(int(main(argv)))
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)
        print("RESULT", codes, heavy, file=sys.stderr)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", check],
        env=node_env(bob),
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("RESULT"), result.stderr
    assert last == "RESULT [0, 0, 0, 0, 0] []", result.stderr
    assert (tmp_path / "b.txt").read_text() == "alpha\n"
    assert "alpha\n" in result.stdout and "shell\n" in result.stdout


def test_without_unix_sockets_the_cli_reaches_the_node_over_loopback_tcp(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """The platform simulation switches unix sockets off (as on Windows): bob's node
    process serves the API on loopback TCP only, and his CLI uses it with the
    home's token, for cp, exec (its shell on TCP too) and run."""
    from tests.integration.conftest import gpumesh

    _alice, bob = pair
    # Pairing started bob's node process on this system's unix socket: the one
    # without unix sockets starts afresh.
    assert gpumesh(bob, "daemon", "stop").returncode == 0
    assert gpumesh(bob, "config", "set", "listen_host", "127.0.0.1").returncode == 0
    report = tmp_path / "platform-report"
    windows = {"GPUMESH_TEST_PLATFORM": "windows", "GPUMESH_TEST_PLATFORM_REPORT": str(report)}
    work = tmp_path / "work"
    work.mkdir()
    (work / "data.bin").write_bytes(b"line\r\n\x00" + os.urandom(100_000))
    up = run_in(bob, work, "cp", "data.bin", "alice-pc:/data.bin", **windows)
    assert up.returncode == 0, up.stderr
    down = run_in(bob, work, "cp", "alice-pc:/data.bin", "back.bin", **windows)
    assert down.returncode == 0, down.stderr
    assert (work / "back.bin").read_bytes() == (work / "data.bin").read_bytes()
    shell = subprocess.run(
        [sys.executable, "-m", "gpumesh", "exec", "alice-pc", "sh", "-c", "cat; exit 4"],
        env=node_env(bob, **windows),
        input="piped\n",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert shell.returncode == 4, shell.stderr
    assert shell.stdout == "piped\n"
    ran = run_in(bob, work, "run", "--peer", "alice-pc", "--", "echo", "ran", **windows)
    assert ran.returncode == 0 and ran.stdout == "ran\n", ran.stderr

    shown = run_in(bob, work, "daemon", "status", "--json", **windows)
    node = json.loads(shown.stdout)["node"]
    assert node is not None, (shown.stderr, (bob / "logs" / "node.log").read_text()[-3000:])
    assert [a.split(":")[0] for a in node["api"]] == ["http"], node["api"]
    assert node["api"][0].startswith("http://127.0.0.1:")
    assert not (bob / "control.sock").exists()
    used = [line for line in report.read_text().splitlines() if line.startswith("used unix")]
    assert not used, used


def test_ctrl_c_during_a_cp_through_the_node_process(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """Ctrl-C while the node process copies: the CLI says `Aborted.` and exits 130
    as in-process, and the next copy works. alice is held stopped (SIGSTOP)
    so the copy cannot finish first; the signal goes once the CLI holds a socket
    (it is then in its command, past start-up)."""
    import signal
    import time

    from tests.integration.node import CEILING

    alice, bob = pair
    work = tmp_path / "work"
    work.mkdir()
    data = os.urandom(2_000_000)
    (work / "big.bin").write_bytes(data)
    assert run_in(bob, work, "cp", "big.bin", "alice-pc:/big.bin").returncode == 0
    share_pid = wait_shares(alice)["agent"]["pid"]
    os.kill(share_pid, signal.SIGSTOP)
    try:
        copy = subprocess.Popen(
            [sys.executable, "-m", "gpumesh", "cp", "alice-pc:/big.bin", "back.bin"],
            env=node_env(bob),
            cwd=work,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + CEILING
        while not _holds_a_socket(copy.pid):
            assert copy.poll() is None, copy.communicate()
            assert time.monotonic() < deadline, "the CLI never reached the node process"
            time.sleep(0.02)
        copy.send_signal(signal.SIGINT)
        _out, err = copy.communicate(timeout=CEILING)
    finally:
        os.kill(share_pid, signal.SIGCONT)
    assert copy.returncode == 130, err
    assert err.strip().splitlines()[-1] == "Aborted."  # click's word for Ctrl-C, as in-process
    assert "Traceback" not in err
    again = run_in(bob, work, "cp", "alice-pc:/big.bin", "back.bin")
    assert again.returncode == 0, again.stderr
    assert (work / "back.bin").read_bytes() == data


def _holds_a_socket(pid: int) -> bool:
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for name in names:
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}").startswith("socket:"):
                return True
        except OSError:
            continue
    return False
