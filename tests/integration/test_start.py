"""``gpumesh start`` driven through a real pseudo-terminal.

The real ``gpumesh`` console script runs with a pty as its controlling
terminal; the tests type keys into the master side and wait (with generous
ceilings, never fixed sleeps) for the text they expect. They check what a
person at the keyboard would see and that the terminal's mode is back as it
was on every way out.
"""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpumesh.identity.codes import PairingOffer, decode_code
from tests.integration.conftest import gpumesh
from tests.integration.test_cli import _free_udp_port, _init
from tests.integration.test_control_api import _free_tcp_port

pytestmark = pytest.mark.usefixtures("gpumesh_processes")

GPUMESH = str(Path(sys.executable).parent / "gpumesh")
UP, DOWN = "\x1b[A", "\x1b[B"
WAIT = 60.0
"""Ceiling for any expected text to appear (a loaded CI box starts Python slowly)."""

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_CODE = re.compile(r"gpm1_[A-Za-z0-9_-]+")


# Make the pty the controlling terminal (so Ctrl-C in cooked mode is a SIGINT, as in a
# real terminal), then become the real `gpumesh` binary: done in the child before exec
# rather than with preexec_fn, which is unsafe in a process with threads.
_AS_SESSION_LEADER = (
    "import fcntl, os, sys, termios; os.setsid(); fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


_READ_SYSCALL = {"x86_64": "0", "aarch64": "63"}.get(os.uname().machine)


def _reading_stdin(pid: int) -> bool:
    """Whether ``pid`` is blocked in read(0, ...); True where Linux cannot tell."""
    if _READ_SYSCALL is None:
        return True
    try:
        fields = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:
        return True
    return fields[:2] == [_READ_SYSCALL, "0x0"]


class Terminal:
    """A real pty with ``gpumesh start`` (or another command) running on it."""

    def __init__(self, home: Path, *args: str, **env: str) -> None:
        self.master, self.slave = os.openpty()
        self.initial = termios.tcgetattr(self.slave)
        variables = dict(os.environ, GPUMESH_HOME=str(home), TERM="xterm", **env)
        variables.pop("GPUMESH_LOG", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _AS_SESSION_LEADER, GPUMESH, *(args or ("start",))],
            stdin=self.slave,
            stdout=self.slave,
            stderr=self.slave,
            env=variables,
        )
        self.raw = b""
        self.seen = 0  # offset in text() up to which expect() has consumed

    def text(self) -> str:
        return _ANSI.sub("", self.raw.decode("utf-8", "replace")).replace("\r", "")

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return False
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: every slave handle is closed
            return False
        self.raw += data
        return bool(data)

    def expect(self, pattern: str) -> re.Match[str]:
        """Wait until ``pattern`` appears after the previous match; fail at the ceiling."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + WAIT
        while True:
            match = regex.search(self.text(), self.seen)
            if match:
                self.seen = match.end()
                return match
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"no {pattern!r} within {WAIT}s; the screen showed:\n{self.text()}")
            self._read(min(left, 1.0))

    def send(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def interrupt_prompt(self) -> None:
        """Ctrl-C at a line prompt, once the process is blocked reading the terminal.

        A SIGINT that lands after Python last checked for signals but before its
        read() starts is only noticed at the next input (CPython's race, not
        ours; no person types that fast), so wait until the read has begun.
        """
        deadline = time.monotonic() + WAIT
        while not _reading_stdin(self.proc.pid) and time.monotonic() < deadline:
            self._read(0.05)
        self.send("\x03")

    def wait(self) -> int:
        deadline = time.monotonic() + WAIT
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._read(0.2)
        code = self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        while self._read(0.05):
            pass
        return code

    def mode(self) -> list[object]:
        return termios.tcgetattr(self.slave)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=WAIT)
        os.close(self.master)
        os.close(self.slave)


@pytest.fixture
def terminals() -> Iterator[list[Terminal]]:
    made: list[Terminal] = []
    yield made
    for terminal in made:
        terminal.close()


Opener = Callable[..., Terminal]


@pytest.fixture
def open_start(terminals: list[Terminal]) -> Opener:
    def start(home: Path, **env: str) -> Terminal:
        terminal = Terminal(home, **env)
        terminals.append(terminal)
        return terminal

    return start


def _offer(code: str) -> PairingOffer:
    return decode_code(code)[0]


def _same_node(a: PairingOffer, b: PairingOffer) -> None:
    """Two codes of one node: equal but for their expiry and nonce."""
    assert (a.name, a.public_key, a.addresses, a.relay) == (
        b.name,
        b.public_key,
        b.addresses,
        b.relay,
    )


def _menu(terminal: Terminal, selected: int = 1) -> None:
    terminal.expect(rf"> {selected}  \S")
    terminal.expect(r"7  Quit")


def test_fresh_home_offers_init_with_a_default_name(open_start: Opener, tmp_path: Path) -> None:
    home = tmp_path / "fresh"
    term = open_start(home, GPUMESH_NODE_NAME="box-default")
    term.expect(r"no node yet")
    term.expect(r"Name for this node \[box-default\]: ")
    term.send("not a name!\r")
    term.expect(r"error: .*name")
    term.expect(r"Name for this node \[box-default\]: ")  # asked again
    term.send("alice-pc\r")
    term.expect(r"Initialized node alice-pc")
    term.expect(r"GPUMesh · alice-pc")
    _menu(term)
    term.send("q")
    assert term.wait() == 0
    assert term.mode() == term.initial
    code = gpumesh(home, "pair-code")
    assert code.returncode == 0, code.stderr
    assert _offer(code.stdout.strip()).name == "alice-pc"


def test_fresh_home_takes_the_default_name_on_enter(open_start: Opener, tmp_path: Path) -> None:
    home = tmp_path / "fresh"
    term = open_start(home, GPUMESH_NODE_NAME="box-default")
    term.expect(r"Name for this node \[box-default\]: ")
    term.send("\r")
    term.expect(r"Initialized node box-default")
    _menu(term)
    term.send("\x1b")  # a lone Esc leaves
    assert term.wait() == 0
    assert _offer(gpumesh(home, "pair-code").stdout.strip()).name == "box-default"


def test_leaving_the_name_prompt_creates_nothing(open_start: Opener, tmp_path: Path) -> None:
    home = tmp_path / "fresh"
    term = open_start(home)
    term.expect(r"Name for this node \[\S+\]: ")
    term.interrupt_prompt()
    term.expect(r"Nothing done")
    assert term.wait() == 130
    assert term.mode() == term.initial
    assert not (home / "identity.key").exists()


def test_pairing_code_by_arrows_and_by_number(open_start: Opener, tmp_path: Path) -> None:
    home = tmp_path / "alice"
    _init(home, "alice-pc", port=_free_udp_port())
    expected = _offer(gpumesh(home, "pair-code").stdout.strip())
    term = open_start(home)
    _menu(term)
    term.send(DOWN)
    term.expect(r"> 2  Share")
    term.send(DOWN)
    term.expect(r"> 3  Show my pairing code")
    term.send("\r")
    by_arrows = term.expect(_CODE.pattern).group()
    term.expect(r"Give this code to your peer")
    _menu(term, selected=3)  # back to the menu, on the entry just run
    term.send("3")
    by_number = term.expect(_CODE.pattern).group()
    _menu(term, selected=3)
    _same_node(_offer(by_arrows), expected)
    _same_node(_offer(by_number), expected)
    assert by_arrows != by_number  # each is a fresh code, as `pair-code` makes
    term.send(UP + UP + UP)  # 3 -> 2 -> 1 -> wraps to 7
    term.expect(r"> 7  Quit")
    term.send("\r")
    assert term.wait() == 0
    assert term.mode() == term.initial


def test_pair_with_a_code_then_run_offers_the_peer(open_start: Opener, tmp_path: Path) -> None:
    alice, bob = tmp_path / "alice", tmp_path / "bob"
    _init(alice, "alice-pc", port=_free_udp_port())
    _init(bob, "bob-laptop", port=_free_udp_port())
    bob_code = gpumesh(bob, "pair-code").stdout.strip()
    port = _free_tcp_port()  # where the dashboard entry's node process serves it
    term = open_start(alice, GPUMESH_API_ADDR=f"127.0.0.1:{port}")
    _menu(term)
    term.send("5")  # run, before any peer
    term.expect(r"No paired peers yet")
    _menu(term, selected=5)
    term.send("4")
    term.expect(r"Paste your peer's pairing code")
    assert term.mode() == term.initial  # the prompt reads in the terminal's own mode
    term.send(bob_code + "\r")
    term.expect(r"Paired with bob-laptop")
    _menu(term, selected=4)
    term.send("6")
    term.expect(r"\$ gpumesh dashboard")
    # The node process started for it serves the dashboard, and the URL is printed.
    term.expect(rf"http://[^/\s]+\.localhost:{port}/#code=")
    _menu(term, selected=6)
    term.send("5")
    term.expect(r"Paired peers: bob-laptop")
    term.expect(r"Peer to run on \[bob-laptop\]: ")
    term.interrupt_prompt()  # Ctrl-C at a prompt: back to the menu, not out
    term.expect(r"Cancelled")
    _menu(term, selected=5)
    term.send("q")
    assert term.wait() == 0
    peers = gpumesh(alice, "peers")
    assert "bob-laptop" in peers.stdout


def test_doctor_entry_runs_the_checks(open_start: Opener, tmp_path: Path) -> None:
    home = tmp_path / "alice"
    _init(home, "alice-pc", port=_free_udp_port())
    term = open_start(home)
    _menu(term)
    term.send("1")
    term.expect(r"\$ gpumesh doctor")
    term.expect(r"identity")
    _menu(term, selected=1)
    term.send("q")
    assert term.wait() == 0


def test_ctrl_c_leaves_with_130_and_restores_the_terminal(
    open_start: Opener, tmp_path: Path
) -> None:
    home = tmp_path / "alice"
    _init(home, "alice-pc", port=_free_udp_port())
    term = open_start(home)
    _menu(term)
    lflag = term.mode()[3]
    assert isinstance(lflag, int)
    assert not lflag & (termios.ECHO | termios.ICANON | termios.ISIG)  # raw while the menu shows
    term.send("\x03")
    assert term.wait() == 130
    assert term.mode() == term.initial


def test_without_a_terminal_it_refuses_with_one_line(tmp_path: Path) -> None:
    home = tmp_path / "alice"
    _init(home, "alice-pc")
    env = dict(os.environ, GPUMESH_HOME=str(home))
    env.pop("GPUMESH_LOG", None)
    piped = subprocess.run(
        [GPUMESH, "start"],
        input="1\n",
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=WAIT,
    )
    assert piped.returncode == 2, piped
    assert piped.stdout == ""
    lines = piped.stderr.strip().splitlines()
    assert len(lines) == 1, piped.stderr
    assert lines[0].startswith("error: ")
    assert "needs a terminal" in lines[0]
    assert "gpumesh init, doctor, share, pair-code, pair, run" in lines[0]
    # A terminal on stdin but output piped to a file is refused the same way.
    master, slave = os.openpty()
    try:
        out = subprocess.run(
            [GPUMESH, "start"],
            stdin=slave,
            check=False,
            capture_output=True,
            text=True,
            env=env,
            timeout=WAIT,
        )
    finally:
        os.close(master)
        os.close(slave)
    assert out.returncode == 2
    assert "needs a terminal" in out.stderr


def test_share_entry_runs_until_ctrl_c_then_returns(open_start: Opener, tmp_path: Path) -> None:
    home = tmp_path / "alice"
    _init(home, "alice-pc", port=_free_udp_port())
    term = open_start(home)
    _menu(term)
    term.send("2")
    term.expect(r"\$ gpumesh share")
    term.expect(_CODE.pattern)  # share prints the pairing code once it listens
    running = gpumesh(home, "status", "--json")
    assert '"sharing": true' in running.stdout, running.stdout
    term.send("\x03")  # Ctrl-C stops sharing, not the menu
    _menu(term, selected=2)
    assert '"sharing": false' in gpumesh(home, "status", "--json").stdout
    term.send("q")
    assert term.wait() == 0
    assert term.mode() == term.initial


def test_run_entry_runs_a_command_on_the_peer(open_start: Opener, pair: tuple[Path, Path]) -> None:
    _alice, bob = pair
    term = open_start(bob)
    _menu(term)
    term.send("5")
    term.expect(r"Peer to run on \[alice-pc\]: ")
    term.send("\r")
    term.expect(r"Command to run \[nvidia-smi\]: ")
    term.send("echo 'made in the menu'\r")
    term.expect(r"\$ gpumesh run --peer alice-pc -- echo 'made in the menu'")
    term.expect(r"\nmade in the menu\n")
    _menu(term, selected=5)
    term.send("q")
    assert term.wait() == 0
    jobs = gpumesh(bob, "jobs", "--json")
    assert "made in the menu" in jobs.stdout
